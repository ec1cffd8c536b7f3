"""The InferenceEngine protocol: what every inference backend (embedded, vLLM, colocated) offers the Session.

:class:`InferenceEngine` is what a workflow samples with. :class:`SessionEngine` adds what a Session asks of the
engine it runs (built from an :class:`EngineContext` by :func:`rlsdk.engine.inference.build_engine`): verifying
the weights it starts with, a weight sync from the trainer (``sync``), the hooks around an update, an unexpected
exit (``wait_failure``) and ``close``. The Session never asks which engine it runs.

Shape names follow docs/glossary.md: ``B`` = sequences in the batch, ``C`` = completion tokens (right-padded).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rlsdk.generation.params import SamplingParams

# SamplingParams lives in rlsdk.generation (the trainer's colocated generation uses it too); re-exported here.
__all__ = ["GenerateResult", "InferenceEngine", "SamplingParams", "WeightInfo"]


@dataclass(frozen=True)
class GenerateResult:
    """One completion per prompt, right-padded to the longest completion ``C``.

    - ``completion_ids_B_C``: int64 token ids; positions past the end hold the pad id.
    - ``completion_mask_B_C``: bool, True for every generated token (the EOS token included).
    - ``logprobs_B_C``: float32 log-probabilities of the sampled tokens under the sampling distribution
      (logits divided by the temperature, before top-k/top-p filtering); 0.0 where the mask is False.
    - ``versions_B_C``: int64 weight version that produced each token; -1 where the mask is False.
    """

    completion_ids_B_C: torch.Tensor
    completion_mask_B_C: torch.Tensor
    logprobs_B_C: torch.Tensor
    versions_B_C: torch.Tensor


@dataclass(frozen=True)
class WeightInfo:
    """What an engine reports about the weights it serves."""

    version: int
    checksum: str
    bytes: int | None = field(default=None, compare=False)
    """What the sync that brought these weights moved (a LoRA run: the adapter only); None when unknown."""


@runtime_checkable
class InferenceEngine(Protocol):
    """An engine that samples completions and receives new weights with their version."""

    async def generate(self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams) -> GenerateResult:
        """Sample one completion for each prompt (token ids in, token ids + logprobs out)."""
        ...

    async def load_weights(self, path: str, version: int) -> WeightInfo:
        """Load the weights published at ``path`` and serve them as ``version``; returns what it now serves.

        Same semantics on every engine: generations already submitted finish on the old weights, later ones
        run on the new weights (the embedded engine serialises on its worker thread; vLLM pauses with
        ``mode=wait`` and always resumes). ``WeightInfo.checksum`` is ``state_dict_checksum`` of the loaded
        weights under the trainer's names.
        """
        ...

    async def weight_info(self) -> WeightInfo:
        """The version and checksum of the weights served now."""
        ...

    async def close(self) -> None:
        """Release the engine's resources; idempotent."""
        ...


@runtime_checkable
class TrainerHandle(Protocol):
    """What an engine may ask of the train ranks: the Session's side of them."""

    @property
    def commands_sent(self) -> int:
        """Rank commands sent so far (an engine compares it to know whether any ran since an update)."""
        ...

    async def broadcast(
        self, command: str, body: dict[str, Any] | list[dict[str, Any]] | None = None, *, timeout_s: float | None
    ) -> list[Any]:
        """Send ``command`` to every rank (one body each, or one for all); the results by rank."""
        ...

    async def export_weights(self) -> dict[str, Any]:
        """Have trainer rank 0 publish its weights (a file, or a LoRA adapter directory) to the Session's publish
        directory; returns ``{"path", "version", "checksum", "bytes"}`` of what it published."""
        ...


@dataclass(frozen=True)
class EngineContext:
    """What an engine's builder gets from the Session (see :func:`rlsdk.engine.inference.build_engine`).

    ``config``: the SessionConfig; ``special_tokens``: the model's pad and EOS ids
    (:class:`~rlsdk.engine.inference.stopping.SpecialTokens`); ``trainer``: the ranks; ``launcher``: the rank
    launcher (a cluster job may run the engine's server, e.g. Slurm's vLLM replicas); ``runtime_dir``: the
    Session's private directory for sockets; ``publish_dir``: where the trainer publishes weights; ``on_line``: shows
    a line a child process printed in the Session's log stream; ``num_threads``: torch threads the controller had
    before the Session lowered its own (an in-process engine's default); ``device_plan``: where the ranks and a
    server the engine starts on this machine run (:class:`rlsdk.config.device.DevicePlan`; None: CPU as before).
    """

    config: Any
    special_tokens: Any
    trainer: TrainerHandle
    launcher: Any = None
    runtime_dir: str | None = None
    publish_dir: str | None = None
    on_line: Callable[[str], None] | None = None
    num_threads: int | None = None
    device_plan: Any = None


@runtime_checkable
class SessionEngine(InferenceEngine, Protocol):
    """An :class:`InferenceEngine` a Session runs: it owns how its weights are verified and synced.

    :class:`EngineLifecycle` gives every hook a default (sync by a published file, nothing around updates, never
    failing on its own); an engine overrides what differs.
    """

    async def verify_initial(self, trainer: Mapping[str, Any], *, resumed: bool) -> WeightInfo | None:
        """After start-up: the weights served now, checked equal to the trainer's (``trainer``: rank 0's ``init``
        result: ``version``, ``checksum``, ``base_checksum``), or None when the Session must sync them first.
        Raises ``WeightMismatchError`` when they differ."""
        ...

    async def sync(self, trainer: TrainerHandle, version: int) -> WeightInfo:
        """Bring the trainer's weights of ``version`` to this engine and verify it serves exactly them: version and
        checksum of what the trainer published. Raises ``WeightMismatchError`` otherwise."""
        ...

    def before_train(self) -> None:
        """The ranks' weights are about to change (an ``update`` or ``sft_update``).

        An engine may also define ``async def prepare_train(self) -> None`` (:class:`EngineLifecycle` has a no-op),
        which the Session awaits right after this hook and before it sends the command: e.g. a vLLM server on the
        rank's GPU frees its memory there. It is optional, so engines written before it still satisfy this
        protocol."""
        ...

    def train_fields(
        self, world: int, next_request: Callable[[], tuple[Sequence[Sequence[int]], SamplingParams] | None]
    ) -> list[dict[str, Any]]:
        """Extra fields of each rank's update body (index = rank). ``next_request()`` gives the prompts and params
        the next default rollout will ask for (None: unknown), for an engine that samples right after training."""
        ...

    def after_train(self, results: list[dict[str, Any]], trainer: TrainerHandle) -> None:
        """The ranks' update results (index = rank), before the Session reads its metrics from them."""
        ...

    async def wait_failure(self) -> BaseException:
        """Return, with the error to report, when the engine stops unexpectedly (a server exits); never returns
        for an engine that cannot fail on its own."""
        ...


def check_synced(info: WeightInfo, published: Mapping[str, Any], version: int) -> WeightInfo:
    """``info`` (what the engine serves after a sync), with the published ``bytes``, when it is ``version`` with the
    checksum the trainer ``published``; raises ``WeightMismatchError`` naming both otherwise."""
    from rlsdk.versioning import WeightMismatchError

    if info.version != version or info.checksum != published["checksum"]:
        raise WeightMismatchError(
            f"engine serves v{info.version} (checksum {info.checksum[:12]}) after sync, "
            f"trainer published v{published['version']} (checksum {published['checksum'][:12]}), "
            f"ledger expects v{version}"
        )
    size = published.get("bytes")
    return WeightInfo(info.version, info.checksum, bytes=None if size is None else int(size))


class EngineLifecycle:
    """Defaults of the :class:`SessionEngine` hooks, for an engine that loads published weights files."""

    async def verify_initial(self, trainer: Mapping[str, Any], *, resumed: bool) -> WeightInfo | None:
        return None  # the Session publishes the trainer's v0 and verifies it like every later sync

    async def sync(self, trainer: TrainerHandle, version: int) -> WeightInfo:
        published = await trainer.export_weights()
        # LoRA: published["path"] is an adapter directory, and only it moves (rlsdk.engine.lora).
        info = await self.load_weights(published["path"], published["version"])  # type: ignore[attr-defined]
        return check_synced(info, published, version)

    def before_train(self) -> None:
        return None

    async def prepare_train(self) -> None:
        return None

    def train_fields(
        self, world: int, next_request: Callable[[], tuple[Sequence[Sequence[int]], SamplingParams] | None]
    ) -> list[dict[str, Any]]:
        return [{} for _ in range(world)]

    def after_train(self, results: list[dict[str, Any]], trainer: TrainerHandle) -> None:
        return None

    async def wait_failure(self) -> BaseException:
        import asyncio

        await asyncio.Event().wait()  # nothing of its own can exit: wait until cancelled
        raise AssertionError("unreachable")
