"""The fused, chunked LM head: values and gradients against a float64 reference and against the one-call path,
and a peak memory that does not grow with the vocabulary."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from rlsdk.algorithms import completion_logprobs, token_entropy, token_logprobs
from rlsdk.algorithms.chunked_head import head_logprobs, tokens_per_chunk

# float32 against float64: today's one-call path (token_logprobs on float32 logits) lands within ~3e-6 of the
# float64 reference on these inputs; the chunked head must stay within the same bound.
RTOL, ATOL = 1e-5, 1e-5


def _inputs(vocab: int = 50, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch, time, hidden = 3, 5, 8
    return {
        "hidden": torch.randn(batch, time, hidden, generator=generator, dtype=torch.float64),
        "weight": torch.randn(vocab, hidden, generator=generator, dtype=torch.float64),
        "bias": torch.randn(vocab, generator=generator, dtype=torch.float64),
        "tokens": torch.randint(0, vocab, (batch, time), generator=generator),
        "grad_logprobs": torch.randn(batch, time, generator=generator, dtype=torch.float64),
        "grad_entropy": torch.randn(batch, time, generator=generator, dtype=torch.float64),
    }


def _reference(x: dict[str, torch.Tensor], temperature: float, entropy_grad: bool) -> list[torch.Tensor]:
    """float64 autograd through the full logits: (logprobs, entropy, d hidden, d weight, d bias)."""
    hidden, weight, bias = (x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    z = (hidden @ weight.T + bias) / temperature
    logprobs = torch.log_softmax(z, dim=-1).gather(-1, x["tokens"][..., None])[..., 0]
    entropy = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    loss = (logprobs * x["grad_logprobs"]).sum()
    if entropy_grad:
        loss = loss + (entropy * x["grad_entropy"]).sum()
    loss.backward()
    return [t.detach() for t in (logprobs, entropy, hidden.grad, weight.grad, bias.grad)]


def _chunked(x: dict[str, torch.Tensor], temperature: float, entropy_grad: bool, chunk_bytes: int) -> list:
    hidden, weight, bias = (x[k].float().clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    logprobs, entropy = head_logprobs(
        hidden, weight, x["tokens"], bias_V=bias, temperature=temperature, with_entropy=True,
        entropy_grad=entropy_grad, chunk_bytes=chunk_bytes,
    )  # fmt: skip
    assert entropy is not None and entropy.requires_grad == entropy_grad
    loss = (logprobs * x["grad_logprobs"].float()).sum()
    if entropy_grad:
        loss = loss + (entropy * x["grad_entropy"].float()).sum()
    loss.backward()
    return [t.detach().double() for t in (logprobs, entropy, hidden.grad, weight.grad, bias.grad)]


def _one_call(x: dict[str, torch.Tensor], temperature: float, entropy_grad: bool) -> list:
    hidden, weight, bias = (x[k].float().clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    logits = hidden @ weight.T + bias
    logprobs, entropy = token_logprobs(logits, x["tokens"], temperature), token_entropy(logits, temperature)
    loss = (logprobs * x["grad_logprobs"].float()).sum()
    if entropy_grad:
        loss = loss + (entropy * x["grad_entropy"].float()).sum()
    loss.backward()
    return [t.detach().double() for t in (logprobs, entropy, hidden.grad, weight.grad, bias.grad)]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("tokens_per_chunk_", [1, 4, 15])  # 15 = every token of the batch in one chunk
def test_head_logprobs_chunked_equals_float64_reference_values_and_gradients(
    temperature: float, entropy_grad: bool, tokens_per_chunk_: int
) -> None:
    x = _inputs()
    expected = _reference(x, temperature, entropy_grad)

    chunked = _chunked(x, temperature, entropy_grad, chunk_bytes=4 * 50 * tokens_per_chunk_)
    today = _one_call(x, temperature, entropy_grad)

    for name, got, base, want in zip(
        ("logprobs", "entropy", "d hidden", "d weight", "d bias"), chunked, today, expected
    ):
        torch.testing.assert_close(base, want, rtol=RTOL, atol=ATOL, msg=f"one-call {name}")
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL, msg=f"chunked {name}")


def test_head_logprobs_without_entropy_returns_none_and_matches_reference() -> None:
    x = _inputs()
    expected = _reference(x, 1.0, entropy_grad=False)
    hidden = x["hidden"].float().requires_grad_()

    logprobs, entropy = head_logprobs(hidden, x["weight"].float(), x["tokens"], bias_V=x["bias"].float(), chunk_bytes=8)
    (logprobs * x["grad_logprobs"].float()).sum().backward()

    assert entropy is None
    torch.testing.assert_close(logprobs.double(), expected[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(hidden.grad.double(), expected[2], rtol=RTOL, atol=ATOL)


def test_head_logprobs_bfloat16_weight_matches_float32_within_bfloat16_rounding() -> None:
    # FSDP2's bf16 parameters: the GEMM in bf16, the log-softmax and its gradient in float32.
    x = _inputs(vocab=200)
    hidden, weight = x["hidden"].float(), x["weight"].float()
    exact, _ = head_logprobs(hidden, weight, x["tokens"])
    weight_bf16 = weight.bfloat16().requires_grad_()

    logprobs, _ = head_logprobs(hidden.bfloat16(), weight_bf16, x["tokens"], chunk_bytes=4 * 200 * 4)
    logprobs.sum().backward()

    assert logprobs.dtype == torch.float32 and weight_bf16.grad.dtype == torch.bfloat16
    # bf16 inputs: ~3 significant digits on logits of magnitude ~10
    torch.testing.assert_close(logprobs, exact, rtol=0.0, atol=0.2)


def test_head_logprobs_under_autocast_keeps_float32_weight_gradient() -> None:
    x = _inputs(vocab=200)
    weight = x["weight"].float().requires_grad_()
    hidden = x["hidden"].float().requires_grad_()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logprobs, _ = head_logprobs(hidden, weight, x["tokens"], chunk_bytes=4 * 200 * 4)
    logprobs.sum().backward()

    assert logprobs.dtype == torch.float32
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    exact, _ = head_logprobs(x["hidden"].float(), x["weight"].float(), x["tokens"])
    torch.testing.assert_close(logprobs, exact, rtol=0.0, atol=0.2)


def test_head_logprobs_bad_shapes_and_budget_raise_naming_them() -> None:
    with pytest.raises(ValueError, match=r"hidden_B_T_H shape \(2, 3, 4\), weight_V_H shape \(5, 6\)"):
        head_logprobs(torch.zeros(2, 3, 4), torch.zeros(5, 6), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        head_logprobs(torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(2, 3, dtype=torch.long), chunk_bytes=0)
    assert tokens_per_chunk(151_936, 32 * 2**20) == 55 and tokens_per_chunk(16, 1) == 1


# --- completion_logprobs through a real transformers model ------------------------------------------------------


@pytest.fixture(scope="module")
def vocab_model() -> torch.nn.Module:
    """A Qwen2-style model with a 300-token vocabulary (tied embeddings), small enough for float64 checks."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


def _batch() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(2)
    prompts = torch.randint(1, 300, (3, 6), generator=generator)
    rows = torch.tensor([0, 1, 0, 2, 1, 0])
    prompt_ids_B_P = prompts[rows]
    prompt_mask_B_P = torch.ones_like(prompt_ids_B_P, dtype=torch.bool)
    prompt_mask_B_P[1::3, :2] = False  # rows of prompt 1 left-padded
    prompt_mask_B_P[4, :2] = False
    completion_ids_B_C = torch.randint(1, 300, (6, 7), generator=generator)
    lengths_B = torch.tensor([7, 3, 5, 1, 7, 6])
    completion_mask_B_C = torch.arange(7)[None, :] < lengths_B[:, None]
    return prompt_ids_B_P, prompt_mask_B_P, completion_ids_B_C, completion_mask_B_C


def _run(model: torch.nn.Module, share: bool, max_logits_bytes: int | None, entropy_grad: bool) -> list:
    inputs = _batch()
    logprobs_B_C, entropy_B_C = completion_logprobs(
        model, *inputs, temperature=0.8, with_entropy=True, entropy_grad=entropy_grad, share_prompts=share,
        max_logits_bytes=max_logits_bytes,
    )  # fmt: skip
    assert entropy_B_C is not None and entropy_B_C.requires_grad == entropy_grad
    mask_B_C = inputs[3]
    loss = (logprobs_B_C * mask_B_C).sum() + (0.1 * (entropy_B_C * mask_B_C).sum() if entropy_grad else 0.0)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return [logprobs_B_C.detach() * mask_B_C, entropy_B_C.detach() * mask_B_C, grads]


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_completion_logprobs_fused_head_equals_materialised_logits(
    vocab_model: torch.nn.Module, share: bool, entropy_grad: bool
) -> None:
    # 4 * 300 * 5 bytes: chunks of 5 tokens, so every call spans several chunks
    plain = _run(vocab_model, share, None, entropy_grad)
    fused = _run(vocab_model, share, 4 * 300 * 5, entropy_grad)

    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-5)
    assert set(fused[2]) == set(plain[2])
    for name, grad in plain[2].items():
        torch.testing.assert_close(fused[2][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_completion_logprobs_fused_head_does_not_leave_the_head_patched(vocab_model: torch.nn.Module) -> None:
    head = vocab_model.get_output_embeddings()

    with torch.no_grad():
        completion_logprobs(vocab_model, *_batch(), max_logits_bytes=64)

    assert "forward" not in vars(head)
    with torch.no_grad():
        assert vocab_model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 300)


def test_completion_logprobs_fused_head_post_processed_logits_raise(vocab_model: torch.nn.Module) -> None:
    class SoftCapped(torch.nn.Module):  # a model that changes the head's output (as Gemma's soft-capping does)
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def get_output_embeddings(self) -> torch.nn.Module:
            return self.inner.get_output_embeddings()

        def forward(self, **kwargs: object) -> object:
            output = self.inner(**kwargs)
            output.logits = 30.0 * torch.tanh(output.logits / 30.0)
            return output

    with torch.no_grad(), pytest.raises(RuntimeError, match="max_logits_bytes=None"):
        completion_logprobs(SoftCapped(vocab_model), *_batch(), max_logits_bytes=64)


# --- peak memory ------------------------------------------------------------------------------------------------

_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from rlsdk.algorithms import completion_logprobs

    vocab, budget = int(sys.argv[1]), (None if sys.argv[2] == "none" else int(sys.argv[2]))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    prompt_ids = torch.randint(0, vocab, (2, 8))
    completion_ids = torch.randint(0, vocab, (2, 248))
    args = (prompt_ids, torch.ones_like(prompt_ids), completion_ids, torch.ones_like(completion_ids))

    def step():
        logprobs, entropy = completion_logprobs(model, *args, with_entropy=True, entropy_grad=True,
                                                max_logits_bytes=budget)
        (logprobs.sum() + entropy.sum()).backward()

    step()  # allocates the gradients and warms the allocator; the measured step reuses them
    model.zero_grad(set_to_none=False)

    def rss_kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1])

    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM (peak RSS) to the current RSS
    base = rss_kib("VmRSS:")
    step()
    print(json.dumps({"peak_mib": (rss_kib("VmHWM:") - base) / 1024}))
    """
)


# glibc's malloc raises its mmap threshold as large blocks are freed (up to 32 MiB), after which it serves them from
# its heap and keeps them mapped when freed: the peak RSS of a step then depends on what earlier steps left cached.
# A fixed threshold maps every block of 128 KiB or more on its own and unmaps it when freed, so RSS follows the live
# tensors. (Setting it also turns glibc's dynamic adjustment off.)
_EXACT_RSS = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def _peak_mib(vocab: int, budget: int | None) -> float:
    proc = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(vocab), "none" if budget is None else str(budget)],
        capture_output=True,
        text=True,
        timeout=240,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path), **_EXACT_RSS},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["peak_mib"])


def _can_reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _can_reset_peak_rss(), reason="needs Linux /proc/self/clear_refs to reset the peak RSS")
def test_completion_logprobs_fused_peak_memory_does_not_grow_with_vocabulary() -> None:
    # 2 x 248 completion tokens: full float32 logits are 2 MiB at V=1,024 and 64 MiB at V=32,768 per [B, C, V]
    # tensor (several live at once on the one-call path). The fused head holds one 4 MiB chunk at a time.
    budget = 4 * 2**20
    small = _peak_mib(1024, budget)
    large = _peak_mib(32768, budget)
    materialised = _peak_mib(32768, None)

    # What may grow with V: a chunk's [rows, V] buffers (the chunk budget caps their bytes) and parameter-sized [V, H]
    # gradient temporaries, a few MiB here; never a [B, C, V] tensor (64 MiB each at V=32,768).
    chunk_mib = budget / 2**20
    assert large - small < 3 * chunk_mib, (small, large)
    # The measurement can see growth: the one-call path at the same V peaks far higher.
    assert materialised > large + 100, (large, materialised)
