"""train.parallelism 'fsdp2' (torch fully_shard) on 2 real gloo ranks gives DDP's updates and DDP's exports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

# Same directory, imported as pytest's rootdir-relative path puts it (prepend import mode).
from test_ddp_gradients import _make_batch

from rlsdk.config import ModelConfig, SessionConfig, TrainConfig
from rlsdk.testing.distributed import run_gloo_ranks

pytestmark = pytest.mark.distributed

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5
# Weights after 3 AdamW steps of lr 1e-2 (each moves a weight by up to ~3e-2): float noise of another reduction
# order, amplified by AdamW (its first steps are ~lr x sign(grad), so near-zero gradient entries turn noise into
# lr-sized steps). FSDP2 runs the shared-prompt path (two forwards per micro-batch) in every step, also where no
# prompt repeats (step 2; uniform_calls: its ranks must make the same model calls), DDP one forward there, and
# FSDP2 reduce-scatters every micro-batch where DDP all-reduces once. How large that noise gets depends on the
# CPU's kernels (AVX2, AVX-512, AMX round differently); the bound stays two orders below one lr-sized step, which
# any real difference in the gradient makes. The key bias's gradient is analytically zero (it shifts every
# attention score of a query equally; softmax is shift-invariant): its whole movement is such noise. The
# gradients themselves match the single-process reference to 1e-6 (tests/engine/test_ddp_gradients.py,
# tests/engine/test_micro_batches.py).
WEIGHT_ATOL = 1e-4
NOISE_ONLY_ATOL = {"self_attn.k_proj.bias": 1e-4}


def _atol(name: str) -> float:
    return next((atol for suffix, atol in NOISE_ONLY_ATOL.items() if name.endswith(suffix)), WEIGHT_ATOL)


# The runs each rank makes: DDP, FSDP2, and FSDP2 keeping the decoder layers gathered from forward to backward.
VARIANTS = {
    "ddp": {"parallelism": "ddp"},
    "fsdp2": {"parallelism": "fsdp2"},
    "fsdp2_kept": {"parallelism": "fsdp2", "fsdp_reshard_after_forward": False},
}


def _run_engine(rank: int, world_size: int, variant: str, model_dir: str, batches: list, out: str) -> dict:
    from accelerate import Accelerator

    from rlsdk.engine.train.engine import TrainEngine

    config = SessionConfig(
        model=ModelConfig(path=model_dir),
        # micro-batches of 2 on a 6-sequence shard: two micro-batches skip the gradient sync
        train=TrainConfig(lr=1e-2, micro_batch_size=2, max_grad_norm=0.5, **VARIANTS[variant]),  # type: ignore[arg-type]
    )
    engine = TrainEngine(config, Accelerator(cpu=True))
    initial = engine.weight_info(with_checksum=True)
    steps: list[dict[str, Any]] = []
    for batch in batches:
        per_rank = batch["advantages_B"].shape[0] // world_size
        shard = {k: v[rank * per_rank : (rank + 1) * per_rank] for k, v in batch.items()}
        result = engine.update(shard, int(batch["completion_mask_B_C"].sum()))
        steps.append({k: result[k] for k in ("loss_sum", "objective", "grad_norm", "tokens", "version")})
    exported = engine.export_weights(str(Path(out) / variant / "publish"), is_writer=rank == 0)
    info = engine.weight_info(with_checksum=rank == 0)
    files = engine.save_checkpoint(str(Path(out) / variant / "ckpt"), is_writer=rank == 0)
    full = engine.full_state_dict(keep=True)
    assert full is not None
    return {
        "initial": initial,
        "steps": steps,
        "exported": exported,
        "info": info,
        "files": files,
        "state": {k: v.clone() for k, v in full.items()},
        "sharded": type(engine.unwrapped).__name__,
    }


def _all(rank: int, world_size: int, model_dir: str, batches: list, out: str) -> dict:
    """Every variant in the same ranks (one process-group start-up instead of three)."""
    return {v: _run_engine(rank, world_size, v, model_dir, batches, out) for v in VARIANTS}


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    """Each rank's results of every variant on the same batches, and the directory they wrote to."""
    model_dir = str(tiny_model_dir)
    out = tmp_path_factory.mktemp("fsdp2")
    # steps 1 and 3 repeat each prompt 3 times: FSDP2 then runs two forwards per micro-batch (shared prompts)
    batches = [_make_batch(model_dir, batch=12, seed=seed, group_size=3 - 2 * (seed % 2)) for seed in range(STEPS)]
    return run_gloo_ranks(_all, 2, model_dir, batches, str(out), timeout_s=300.0), out


def test_fsdp2_two_gloo_ranks_three_updates_match_ddp_losses_weights_and_export(
    runs: tuple[list[dict], Path], tiny_model_dir: Path
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = str(tiny_model_dir)
    ranks, tmp_path = runs

    for rank, result in enumerate(ranks):
        ddp, fsdp2 = result["ddp"], result["fsdp2"]
        assert fsdp2["sharded"].startswith("FSDP"), fsdp2["sharded"]
        assert fsdp2["initial"] == ddp["initial"]  # identical weights before any update: identical checksum
        for step, (a, b) in enumerate(zip(ddp["steps"], fsdp2["steps"], strict=True)):
            assert b["version"] == a["version"] == step + 1
            assert b["tokens"] == a["tokens"]
            for key in ("loss_sum", "objective", "grad_norm"):
                torch.testing.assert_close(b[key], a[key], rtol=RTOL, atol=ATOL, msg=f"rank {rank} {key} {step}")
        assert set(fsdp2["state"]) == set(ddp["state"])
        for name, tensor in ddp["state"].items():
            torch.testing.assert_close(fsdp2["state"][name], tensor, rtol=RTOL, atol=_atol(name), msg=name)
    # the full state dict is the same on every rank after the update
    for name, tensor in ranks[0]["fsdp2"]["state"].items():
        torch.testing.assert_close(ranks[1]["fsdp2"]["state"][name], tensor, rtol=0, atol=0, msg=name)

    # export: only rank 0 writes; the file has DDP's tensor names (tied duplicate dropped the same way) and values
    ddp_export, fsdp2_export = ranks[0]["ddp"]["exported"], ranks[0]["fsdp2"]["exported"]
    assert ranks[1]["fsdp2"]["exported"] == {"version": STEPS}
    assert fsdp2_export["version"] == ddp_export["version"] == STEPS
    ddp_file, fsdp2_file = load_file(ddp_export["path"]), load_file(fsdp2_export["path"])
    assert set(fsdp2_file) == set(ddp_file)
    for name, tensor in ddp_file.items():
        torch.testing.assert_close(fsdp2_file[name], tensor, rtol=RTOL, atol=_atol(name), msg=name)
    # the checksum is the trainer's full state dict, as weight_info reports it, and loads into the model
    from rlsdk.engine.weights import state_dict_checksum

    assert ranks[0]["fsdp2"]["info"]["checksum"] == fsdp2_export["checksum"]
    assert state_dict_checksum(ranks[0]["fsdp2"]["state"]) == fsdp2_export["checksum"]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.load_state_dict(fsdp2_file, strict=False)
    assert state_dict_checksum(model.state_dict()) == fsdp2_export["checksum"]

    # checkpoint: a loadable transformers directory with the same weights, and the full optimizer state
    assert "trainer_state.pt" in ranks[0]["fsdp2"]["files"]
    assert ranks[1]["fsdp2"]["files"] == ["rng_rank1.pt"]
    restored = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp2" / "ckpt" / "model")
    assert type(restored).__name__ == "Qwen2ForCausalLM"
    assert state_dict_checksum(restored.state_dict()) == fsdp2_export["checksum"]
    state = torch.load(tmp_path / "fsdp2" / "ckpt" / "trainer_state.pt", weights_only=False)
    assert state["version"] == STEPS and state["optimizer_format"] == "fsdp2_full"
    exp_avg = state["optimizer"]["state"]["model.embed_tokens.weight"]["exp_avg"]
    assert exp_avg.shape == ranks[0]["ddp"]["state"]["model.embed_tokens.weight"].shape  # gathered, not a shard


def test_fsdp2_keeping_layers_gathered_after_forward_gives_the_same_updates_weights_and_export(
    runs: tuple[list[dict], Path],
) -> None:
    ranks, _ = runs
    for rank, result in enumerate(ranks):
        resharded, kept = result["fsdp2"], result["fsdp2_kept"]
        assert kept["sharded"].startswith("FSDP"), kept["sharded"]
        for step, (a, b) in enumerate(zip(resharded["steps"], kept["steps"], strict=True)):
            assert b["version"] == a["version"] and b["tokens"] == a["tokens"]
            for key in ("loss_sum", "objective", "grad_norm"):
                # same gathers, reductions and kernels in the same order; only when the gathered copy is freed differs
                torch.testing.assert_close(b[key], a[key], rtol=1e-6, atol=1e-7, msg=f"rank {rank} {key} {step}")
        for name, tensor in resharded["state"].items():
            torch.testing.assert_close(kept["state"][name], tensor, rtol=1e-6, atol=1e-7, msg=name)
    assert ranks[0]["fsdp2_kept"]["exported"]["checksum"] == ranks[0]["fsdp2"]["exported"]["checksum"]
