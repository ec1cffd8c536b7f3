"""Rank-tagged records: shipped as dicts, shown with their tag, written one file per rank."""

from __future__ import annotations

import io
import logging
from pathlib import Path

from rlsdk.observe.logging import RankLogRouter, ShippingHandler, format_tag


def test_shipping_handler_stamps_component_rank_world_and_version() -> None:
    shipped: list[dict] = []
    logger = logging.getLogger("rlsdk.engine.test_stamp")
    handler = ShippingHandler(shipped.append)
    logger.addHandler(handler)
    try:
        logger.warning("loss is %s", "fine", extra={"rank": 1, "world_size": 2, "version": 7})
    finally:
        logger.removeHandler(handler)

    (record,) = shipped
    assert record["component"] == "engine"
    assert (record["rank"], record["world_size"], record["version"]) == (1, 2, 7)
    assert record["message"] == "loss is fine"
    assert format_tag(record) == "[rank 1/2 engine v7]"


def test_router_writes_one_file_per_rank_and_shows_tagged_lines(tmp_path: Path) -> None:
    stream = io.StringIO()
    router = RankLogRouter(tmp_path / "logs", console=True, level=logging.INFO, stream=stream)
    base = {"time": 0.0, "level": "INFO", "levelno": logging.INFO, "logger": "rlsdk.worker", "role": "train"}

    router.handle({**base, "component": "worker", "rank": 0, "world_size": 2, "version": 3, "message": "a"})
    router.handle({**base, "component": "worker", "rank": 1, "world_size": 2, "version": 3, "message": "b"})
    router.handle({**base, "levelno": logging.DEBUG, "component": "worker", "rank": 1, "message": "hidden"})
    router.close()

    assert "a" in (tmp_path / "logs" / "rank_0.log").read_text()
    assert "hidden" not in (tmp_path / "logs" / "rank_1.log").read_text()
    assert "[rank 1/2 worker v3] b" in stream.getvalue()
