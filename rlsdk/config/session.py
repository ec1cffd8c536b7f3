"""SessionConfig: the whole run's configuration, one section per component."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlsdk.config.components import (
    AlgorithmConfig,
    DataConfig,
    InferenceConfig,
    LaunchConfig,
    ModelConfig,
    ObserveConfig,
    RolloutConfig,
    TrainConfig,
)
from rlsdk.config.errors import ConfigError
from rlsdk.config.validate import check_types, require

# Advantage estimators that compare a sample with the other samples of its prompt's group, and why a group of
# one sample cannot work with each (SessionConfig refuses rollout.group_size 1 with them).
_GROUP_RELATIVE = {
    "grpo": "a group-centred advantage of one sample is always 0, so nothing is trained",
    "dr_grpo": "a group-centred advantage of one sample is always 0, so nothing is trained",
    "rloo": "the leave-one-out baseline needs another sample of the same prompt",
    "reinforce_pp_baseline": "the group baseline of one sample is the sample itself, so every advantage is 0",
}


@dataclass
class SessionConfig:
    """Everything a Session needs; each section is validated by its own class.

    Across sections: ``launch.num_ranks`` <= ``data.prompts_per_step`` x ``rollout.group_size`` (every rank
    trains on at least one sample per step); a group-relative advantage ('grpo', 'dr_grpo', 'rloo',
    'reinforce_pp_baseline') needs ``rollout.group_size`` >= 2;
    ``inference.vllm.weight_transfer='inplace'`` needs the engine to serve ``model.dtype`` and
    ``launch.gpus_per_node=0``; ``train.mixed_precision='bf16'`` needs ``model.dtype='float32'``;
    ``inference.engine='colocated'`` needs ``train.parallelism='ddp'`` and ``rollout.mode='sequential'``;
    ``train.mini_batch_size`` is a multiple of ``launch.num_ranks`` and at most ``data.prompts_per_step`` x
    ``rollout.group_size``.
    """

    model: ModelConfig
    """The policy model (required)."""
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    """Train-rank processes and their supervision."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """The inference engine."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer and training loop."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Policy-gradient algorithm."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and staleness policy."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt data set."""
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    """Logs, metrics and artifacts."""
    seed: int = 0
    """Seed for data order, sampling and initialisation, >= 0."""
    # TODO(config): constrain run_name (non-empty? path-safe?) once observe/ decides how it is used.
    run_name: str = "run"
    """Name of the run, shown in logs and metrics."""

    def __post_init__(self) -> None:
        check_types(self)
        require(self, "seed", self.seed >= 0, "an int >= 0")
        self._validate_cross()

    def _validate_cross(self) -> None:
        """Checks spanning sections go here, raising ConfigError naming every field involved."""
        served = self.inference.dtype or self.model.dtype
        if self.inference.vllm.weight_transfer == "inplace" and served != self.model.dtype:
            raise ConfigError(
                "inference.dtype",
                self.inference.dtype,
                f"None or model.dtype ({self.model.dtype!r}) when inference.vllm.weight_transfer='inplace' (it copies "
                "the published bytes straight into the served weights; use 'reload' to serve another dtype)",
            )
        if self.train.mixed_precision == "bf16" and self.model.dtype != "float32":
            raise ConfigError(
                "model.dtype",
                self.model.dtype,
                "'float32' when train.mixed_precision='bf16' (the master weights, gradients and optimizer states "
                "stay float32; for pure bf16 training set model.dtype='bfloat16' and train.mixed_precision='no')",
            )
        if self.inference.engine == "colocated" and self.train.parallelism != "ddp":
            raise ConfigError(
                "train.parallelism",
                self.train.parallelism,
                "'ddp' when inference.engine='colocated' (each rank generates on its own full replica; an 'fsdp2' "
                "forward all-gathers, so every rank would have to run the same number of decode steps)",
            )
        if self.inference.engine == "colocated" and self.rollout.mode == "async":
            raise ConfigError(
                "rollout.mode",
                self.rollout.mode,
                "'sequential' when inference.engine='colocated' (the ranks generate and train one after the "
                "other, so there is nothing to overlap; use inference.engine='embedded' or 'vllm' for 'async')",
            )
        if self.inference.vllm.weight_transfer == "inplace" and self.launch.gpus_per_node > 0:
            raise ConfigError(
                "inference.vllm.weight_transfer",
                self.inference.vllm.weight_transfer,
                f"'auto' or 'reload' when launch.gpus_per_node = {self.launch.gpus_per_node} > 0 ('inplace' is the "
                "CPU path: it copies a shared-memory file into plain CPU weights)",
            )
        advantage = self.algorithm.resolved().advantage
        if advantage in _GROUP_RELATIVE and self.rollout.group_size < 2:
            # A group of one sample is its own baseline: every advantage is 0 and the update trains nothing
            # (grad norm 0), silently; refused like RLOO, whose leave-one-out baseline does not exist.
            raise ConfigError(
                "rollout.group_size",
                self.rollout.group_size,
                f"an int >= 2 when algorithm.advantage is {advantage!r} (algorithm.name={self.algorithm.name!r}): "
                f"{_GROUP_RELATIVE[advantage]}; use algorithm.name='reinforce_pp' (batch-normalised, no group "
                "baseline) for one sample per prompt",
            )
        samples = self.data.prompts_per_step * self.rollout.group_size
        self._validate_mini_batch(samples)
        if samples < self.launch.num_ranks:
            # Session.update splits a step's samples equally over the ranks; with fewer samples than ranks the
            # first update would fail only after every process had started.
            raise ConfigError(
                "launch.num_ranks",
                self.launch.num_ranks,
                f"at most data.prompts_per_step x rollout.group_size = {self.data.prompts_per_step} x "
                f"{self.rollout.group_size} = {samples} (each rank trains on at least one sample per step)",
            )

    def _validate_mini_batch(self, samples: int) -> None:
        """``train.mini_batch_size``: every rank takes an equal share of each mini-batch (SPMD: the same number
        of optimizer steps and collectives on every rank), and a mini-batch larger than the batch means nothing."""
        size = self.train.mini_batch_size
        if size is None:
            return
        if size % self.launch.num_ranks != 0:
            raise ConfigError(
                "train.mini_batch_size",
                size,
                f"a multiple of launch.num_ranks = {self.launch.num_ranks} (each rank takes an equal share of every "
                "mini-batch, so every rank runs the same optimizer steps), or None",
            )
        if size > samples:
            raise ConfigError(
                "train.mini_batch_size",
                size,
                f"at most data.prompts_per_step x rollout.group_size = {self.data.prompts_per_step} x "
                f"{self.rollout.group_size} = {samples} (the sequences of one update), or None",
            )
