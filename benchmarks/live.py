"""LiveWeights against a reference engine's reload, on a real transformers Llama.

    .venv/bin/python benchmarks/live.py                          # two sizes, CPU
    .venv/bin/python benchmarks/live.py --sizes 512x8 --steps 3 --json
    .venv/bin/python benchmarks/live.py --device cuda --sizes 4096x16   # on a GPU machine

Per size (``HIDDENxLAYERS``, a Llama with a 32000-token vocabulary built from a config: nothing
is downloaded), a trainer holds fp32 master weights and takes ``--steps`` AdamW steps at an
RL-like learning rate, each published as bf16 (encoding ``auto``). Two engines hold the bf16
model on ``--device``:

* **live**: kept current by ``LiveWeights``: ``stage`` (pull + patches, outside the pause),
  then ``commit`` (the pause: only the changed elements are written, read back to verify);
* **reference**: ``pull_weights`` into its own local checkpoint, then the reload a reference
  engine does in its pause: ``safetensors`` load of the local checkpoint + a copy into the model.

Prints, best of the steps, commit vs reload and stage vs pull, the density (changed bf16
elements), and a version that changes nothing (its commit time). Both engines are checked
bit-exact against the trainer after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from deltastore import DeltaPublisher, pull_weights
from deltastore.engines import LiveWeights

VOCAB = 32000


def config_of(size: str) -> LlamaConfig:
    hidden, layers = (int(x) for x in size.split("x"))
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 64 * 64 or 64,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )


def bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().to(torch.bfloat16).contiguous() for n, t in model.state_dict().items()}


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def reload(model: torch.nn.Module, directory: Path) -> None:
    """What a reference engine does in its pause: load the checkpoint, copy it into the model."""
    params = model.state_dict()
    with torch.no_grad():
        for path in sorted(directory.glob("*.safetensors")):
            for name, tensor in load_file(str(path)).items():
                params[name].copy_(tensor)
    if params and next(iter(params.values())).device.type == "cuda":
        torch.cuda.synchronize()


def engine(config: LlamaConfig, state: dict[str, torch.Tensor], device: str) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.load_state_dict(state)
    return model.to(device).eval()


def same(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    live = model.state_dict()
    return all(
        torch.equal(live[n].cpu().view(torch.int16), t.view(torch.int16)) for n, t in state.items()
    )


def bench_size(size: str, args: argparse.Namespace, work: Path) -> dict[str, object]:
    torch.manual_seed(0)
    config = config_of(size)
    master = LlamaForCausalLM(config).float()
    params = sum(p.numel() for p in master.parameters())
    state = bf16(master)
    base = work / "base"
    base.mkdir(parents=True)
    save_file(state, str(base / "model.safetensors"))
    publisher = DeltaPublisher(str(work / "store"), str(base), encoding=args.encoding)
    publisher.seed()
    optimizer = torch.optim.AdamW(master.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(1)
    live_model = engine(config, state, args.device)
    ref_model = engine(config, state, args.device)
    live = LiveWeights(live_model, work / "live", str(work / "store"), base_dir=base)
    rows = []
    for step in range(args.steps + 1):
        tokens = torch.randint(0, VOCAB, (1, 32), generator=gen)
        master(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        state = bf16(master)
        version = publisher.publish(state.items()).version
        pull_s, _ = timed(
            lambda v=version: pull_weights(work / "ref", str(work / "store"), v, base)
        )
        reload_s, _ = timed(lambda: reload(ref_model, work / "ref"))
        stage_s, staged = timed(lambda v=version: live.stage(v))
        commit = live.commit(staged)  # type: ignore[arg-type]
        if step == 0:
            continue  # the first stage also seeds both local checkpoints from the base
        rows.append(
            {
                "stage_s": stage_s,
                "pull_s": pull_s,
                "commit_s": commit.seconds,
                "reload_s": reload_s,
                "density": commit.elements / params,
                "staged_bytes": staged.bytes,  # type: ignore[attr-defined]
            }
        )
    assert same(live_model, state) and same(ref_model, state), "an engine is not bit-exact"
    nochange = []
    for _ in range(3):
        version = publisher.publish(state.items()).version
        staged = live.stage(version)
        nochange.append(live.commit(staged).seconds)
    best = {k: min(float(r[k]) for r in rows) for k in rows[0]}  # type: ignore[arg-type]
    return {
        "size": size,
        "params": params,
        "model_bytes": params * 2,
        "device": args.device,
        **best,
        "commit_over_reload": best["commit_s"] / best["reload_s"],
        "stage_over_pull": best["stage_s"] / best["pull_s"],
        "nochange_commit_s": min(nochange),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--sizes",
        nargs="+",
        default=["512x4", "1024x6"],
        help="HIDDENxLAYERS of each Llama (vocabulary 32000)",
    )
    parser.add_argument("--steps", type=int, default=5, help="measured AdamW steps (best of)")
    parser.add_argument(
        "--lr",
        type=float,
        default=3.3e-7,
        help="AdamW learning rate (about 0.4 %% of bf16 elements change a step)",
    )
    parser.add_argument("--encoding", default="auto")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--json", action="store_true", help="print one JSON object per size")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA device; none is available here")
    warnings.filterwarnings("ignore", message=".*changed .* of the model's bytes")
    torch.set_grad_enabled(True)
    print(f"load: {os.getloadavg()[0]:.1f} (1 min), {os.cpu_count()} cores")
    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="deltastore-live-") as work:
            out = bench_size(size, args, Path(work))
        if args.json:
            print(json.dumps(out))
            continue
        print(
            f"{size}: {out['params'] / 1e6:.1f} M params ({out['model_bytes'] / 2**20:.0f} MiB "
            f"bf16) on {args.device}, density {out['density']:.3%}\n"
            f"  commit {out['commit_s'] * 1e3:.2f} ms vs reload {out['reload_s'] * 1e3:.1f} ms: "
            f"{out['commit_over_reload']:.3f}x\n"
            f"  stage {out['stage_s']:.3f} s vs pull {out['pull_s']:.3f} s: "
            f"{out['stage_over_pull']:.2f}x (patches hold {out['staged_bytes'] / 2**20:.1f} MiB)\n"
            f"  no-change version: commit {out['nochange_commit_s'] * 1e3:.3f} ms"
        )


if __name__ == "__main__":
    main()
