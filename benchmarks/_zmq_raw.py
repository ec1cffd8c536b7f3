"""Raw pyzmq ROUTER/DEALER no-op round trip: the floor that the control channel's no-op broadcast is compared to.

One ROUTER in this process, ``num_peers`` DEALER peers in spawned processes. Each iteration sends one tiny
message to every peer and waits until every peer has echoed it: no signing, no pickling, no asyncio.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time

import zmq

_READY = b"ready"
_STOP = b"stop"
_RECV_TIMEOUT_MS = 30_000


def _peer_main(address: str, identity: bytes) -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, _RECV_TIMEOUT_MS)
    sock.connect(address)
    try:
        sock.send(_READY)
        while True:
            message = sock.recv()
            if message == _STOP:
                return
            sock.send(message)
    except zmq.Again:
        return  # the benchmark process went away
    finally:
        sock.close()
        context.term()


def raw_roundtrip_us(num_peers: int, iterations: int, *, warmup: int = 20) -> list[float]:
    """Per-iteration latency in microseconds of a no-op round trip to ``num_peers`` peer processes.

    ``warmup`` iterations run first and are not returned.

    Raises:
        ValueError: ``num_peers < 1``, ``iterations < 1`` or ``warmup < 0``.
        TimeoutError: a peer did not start, or did not answer, within 30 s.
    """
    if num_peers < 1 or iterations < 1 or warmup < 0:
        raise ValueError(
            f"num_peers={num_peers!r}, iterations={iterations!r}, warmup={warmup!r} are invalid: allowed "
            "num_peers >= 1, iterations >= 1, warmup >= 0"
        )
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.RCVTIMEO, _RECV_TIMEOUT_MS)
    router.bind("tcp://127.0.0.1:*")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)
    spawn = multiprocessing.get_context("spawn")
    identities = [b"peer-%d" % index for index in range(num_peers)]
    peers = [spawn.Process(target=_peer_main, args=(address, identity), daemon=True) for identity in identities]
    for peer in peers:
        peer.start()
    latencies_us: list[float] = []
    try:
        ready = set()
        while len(ready) < num_peers:
            identity, message = _recv(router)
            if message == _READY:
                ready.add(identity)
        for iteration in range(warmup + iterations):
            started = time.perf_counter_ns()
            for identity in identities:
                router.send_multipart([identity, b"noop"])
            for _ in identities:
                _recv(router)
            elapsed_us = (time.perf_counter_ns() - started) / 1000.0
            if iteration >= warmup:
                latencies_us.append(elapsed_us)
        for identity in identities:
            router.send_multipart([identity, _STOP])
    finally:
        for peer in peers:
            peer.join(timeout=5.0)
        for peer in peers:
            if peer.is_alive():
                peer.terminate()
                peer.join(timeout=2.0)
        router.close(linger=0)
        context.term()
    return latencies_us


def _recv(router: zmq.Socket[bytes]) -> tuple[bytes, bytes]:
    try:
        identity, message = router.recv_multipart()
    except zmq.Again as exc:
        raise TimeoutError(f"no peer message within {_RECV_TIMEOUT_MS / 1000:g} s") from exc
    return identity, message


if __name__ == "__main__":
    for peers in (2, 4):
        samples = raw_roundtrip_us(peers, 500)
        print(
            f"raw zmq no-op round trip, {peers} peers: median {statistics.median(samples):.0f} us, "
            f"p90 {statistics.quantiles(samples, n=10)[-1]:.0f} us ({len(samples)} iterations)"
        )
