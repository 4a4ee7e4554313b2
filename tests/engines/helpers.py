"""A real training run for the LiveWeights tests: a tiny transformers Llama built from a config
(nothing downloaded), trained with AdamW on an fp32 master copy, each step published as bf16.

``run.states[v]`` keeps the trainer's bf16 tensors at each version, so a test compares the live
weights with what the trainer had, independently of the published digests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from deltastore import DeltaPublisher
from tests.conftest import make_checkpoint

VOCAB = 96


def tiny_config(hidden: int = 32, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def bf16_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as the trainer publishes them: bf16 copies of the fp32 master."""
    return {n: t.detach().to(torch.bfloat16).clone() for n, t in model.state_dict().items()}


@dataclass
class TrainingRun:
    """A trainer: fp32 master weights, AdamW, a publisher writing bf16 versions to a store."""

    store_dir: Path
    base_dir: Path
    config: LlamaConfig
    master: LlamaForCausalLM
    publisher: DeltaPublisher
    optimizer: torch.optim.Optimizer
    states: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    generator: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(1))

    @classmethod
    def start(
        cls, root: Path, *, encoding: str = "auto", lr: float = 3e-4, seed: int = 0, **config: int
    ) -> TrainingRun:
        torch.manual_seed(seed)
        cfg = tiny_config(**config)
        master = LlamaForCausalLM(cfg).float()
        base_dir = make_checkpoint(root / "base", bf16_state(master))
        publisher = DeltaPublisher(str(root / "store"), str(base_dir), encoding=encoding)
        publisher.seed()
        optimizer = torch.optim.AdamW(master.parameters(), lr=lr)
        run = cls(root / "store", base_dir, cfg, master, publisher, optimizer)
        run.states[0] = bf16_state(master)
        return run

    def step(self, *, full: bool = False, train: bool = True) -> int:
        """One AdamW step on random tokens (or none), published; returns the version."""
        if train:
            tokens = torch.randint(0, VOCAB, (2, 12), generator=self.generator)
            loss = self.master(input_ids=tokens, labels=tokens).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad()
        state = bf16_state(self.master)
        result = self.publisher.publish(state.items(), full=full)
        self.states[result.version] = state
        return result.version


def engine_model(config: LlamaConfig, state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    """An engine's bf16 model holding ``state`` (as if loaded from a checkpoint)."""
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.load_state_dict(state)
    return model


def load_checkpoint_model(config: LlamaConfig, directory: Path) -> LlamaForCausalLM:
    """A fresh engine model loaded from a checkpoint directory's safetensors files."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(path)))
    return engine_model(config, state)


def live_bytes(model: torch.nn.Module) -> dict[str, bytes]:
    return {n: raw(t) for n, t in model.state_dict().items()}


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def greedy(model: torch.nn.Module, prompt: torch.Tensor, tokens: int = 8) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
