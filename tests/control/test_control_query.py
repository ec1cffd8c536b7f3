"""``query``/``reply``: the controller asks each rank's event thread for state while commands are running."""

from __future__ import annotations

import asyncio

from _control_helpers import new_controller, rank_threads, run

from rlsdk.control import ControlError


def test_query_is_answered_by_event_threads_while_a_command_blocks_the_ranks() -> None:
    async def body() -> tuple[dict, dict, list]:
        channel, secret, session_id = new_controller()
        await channel.start()
        try:
            with rank_threads(channel, 2, secret, session_id) as ranks:
                ranks[0].set_query_handler("state", lambda _body: {"rank": 0, "busy": True})
                ranks[1].set_query_handler("state", lambda _body: 1 / 0)
                await channel.wait_for_ranks(2, 10.0)
                command = asyncio.ensure_future(channel.broadcast("sleep", {"seconds": [1.5, 1.5]}))
                await asyncio.sleep(0.3)  # both ranks are now inside the command
                during = await channel.query_events("state", 2.0)
                unknown = await channel.query_events("nothing", 2.0)
                return during, unknown, await command
        finally:
            await channel.close()

    during, unknown, results = run(body)

    assert during[0] == {"rank": 0, "busy": True}
    assert isinstance(during[1], ControlError) and "ZeroDivisionError" in str(during[1])
    assert all(isinstance(value, ControlError) and "no handler" in str(value) for value in unknown.values())
    assert results == [0, 1]
