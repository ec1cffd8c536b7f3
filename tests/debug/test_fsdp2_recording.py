"""FSDP2 (``fully_shard``) on 2 real gloo ranks with the traced backend as WORLD: its all-gathers and
reduce-scatters are recorded (torch 2.13 calls ``ProcessGroup.all_gather_single`` / ``reduce_scatter_single``,
which the traced backend forwards to gloo's ``_allgather_base`` / ``_reduce_scatter_base``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlsdk.testing.distributed import run_gloo_ranks

pytestmark = pytest.mark.distributed


def _site(marker: str) -> str:
    for number, line in enumerate(Path(__file__).read_text().splitlines(), start=1):
        if f"# {marker}" in line and "_site(" not in line:
            return f"{__file__}:{number}"
    raise AssertionError(marker)


def _fsdp2_step(rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import fully_shard

    from rlsdk.debug import tracer

    tracer.init_traced_process_group()  # WORLD on the traced backend, as the worker creates it
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x_B_D = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    model(x_B_D).square().mean().backward()  # FSDP_STEP_SITE
    opt.step()
    return tracer.snapshot()


@pytest.mark.slow  # 18 s alone, up to 90 s on 2 loaded cores
def test_fsdp2_step_records_all_gathers_and_reduce_scatters_with_matching_sequences_and_no_divergence() -> None:
    from rlsdk.debug.analyze import analyze

    snaps = run_gloo_ranks(_fsdp2_step, 2)

    # Linear(8, 16): 128 + 16 = 144 elements, 72 per rank; Linear(16, 4): 64 + 4 = 68, 34 per rank
    calls = [[(r["seq"], r["op"], r["shapes"], r["reduce_op"]) for r in snap["records"]] for snap in snaps]
    assert calls[0] == calls[1]
    assert [(op, shapes) for _, op, shapes, _ in calls[0]] == [
        ("all_gather_single", ((72,),)),  # forward: layer 0
        ("all_gather_single", ((34,),)),  # forward: layer 2
        ("all_gather_single", ((34,),)),  # backward: layer 2, resharded after forward
        ("all_gather_single", ((72,),)),  # backward: layer 0
        ("reduce_scatter_single", ((68,),)),  # gradients: input is the unsharded flat size
        ("reduce_scatter_single", ((144,),)),
    ]
    assert [seq for seq, *_ in calls[0]] == list(range(1, 7))
    assert {reduce_op for _, op, _, reduce_op in calls[0] if op == "reduce_scatter_single"} == {"AVG"}
    for snap in snaps:
        assert all(r["group"] == "0" and not r["p2p"] and r["t_end"] is not None for r in snap["records"])
        assert all(r["site"] == _site("FSDP_STEP_SITE") for r in snap["records"])
    report = analyze(dict(enumerate(snaps)))
    assert report.ok, str(report)
