"""Wire size and codec time of every delta encoding against the reference ``xor`` + zstd-1.

One process, one thread pool of ``--threads`` workers shared by every encoding (one tensor per
task, like the publisher), the same old/new tensors for all. Per encoding:

- wire: the bytes of every changed tensor's zstd-1 frame, as a ratio of ``xor``'s and as a
  percentage of the model;
- encode: encode + zstd-1 frame of every tensor (the publisher's per-tensor codec work, without
  checksums or writes), best of ``--repeat``, as a ratio of ``xor``'s;
- apply: bounded decompress + apply in place onto a copy of the old bytes, best of
  ``--repeat``, as a ratio of ``xor``'s; every result is checked bit-exact against the new bytes.

Models:
- ``--model synthetic`` (default): ``deltastore demo``'s transformer layout, fp32 master weights
  and their bf16 cast, one Adam-like step (every master weight moves by ±lr); ``--lr`` sets
  the element density (6.5e-8 gives about 0.40 %).
- ``--model moe``: ``--tensors`` expert tensors of 64 KB bf16 (8,000: 524 MB), the same
  Adam-like step: per-tensor overhead at scale (``--lr 1.4e-7`` gives about 0.85 %).
- ``--model tiny-transformer``: a small torch ``nn.TransformerEncoder`` (hundreds of small
  tensors: biases, norms) trained one real Adam step on random tokens, bf16 copies before and
  after: per-tensor overhead and a real optimizer's update pattern.

    python benchmarks/encodings.py                              # 512 MB synthetic, 2 threads
    python benchmarks/encodings.py --size 64 --repeat 1         # quick look
    python benchmarks/encodings.py --model moe --lr 1.4e-7
    python benchmarks/encodings.py --model tiny-transformer --lr 1e-5
    python benchmarks/encodings.py --json                       # one JSON object
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from deltastore.codecs import ENCODINGS, compress, decompress
from deltastore.publish.snapshot import tensor_bytes

Pair = tuple[str, np.ndarray, np.ndarray, int]
"""(name, old bytes, new bytes, element size)."""


@dataclass(frozen=True)
class Row:
    """One encoding's figures."""

    encoding: str
    wire_bytes: int
    wire_pct_of_model: float
    wire_vs_xor: float
    encode_s: float
    encode_vs_xor: float
    apply_s: float
    apply_vs_xor: float


def synthetic_pairs(size_mb: float, lr: float, seed: int) -> list[Pair]:
    from deltastore.cli.demo import SyntheticTraining

    training = SyntheticTraining(size_mb, seed)
    before = {name: tensor_bytes(name, t).copy() for name, t in training.model.items()}
    training.step(lr)
    return [(n, before[n], tensor_bytes(n, t), 2) for n, t in training.model.items()]


def moe_pairs(tensors: int, lr: float, seed: int) -> list[Pair]:
    """``tensors`` expert tensors of 64 KB bf16 (32,768 elements each), one Adam-like step."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    master = torch.randn((tensors, 32768), generator=generator) * 0.02
    before = master.to(torch.bfloat16)
    master.add_(torch.randn(master.shape, generator=generator).sign_() * lr)
    after = master.to(torch.bfloat16)
    return [
        (f"experts.{i}.weight", tensor_bytes("e", before[i]), tensor_bytes("e", after[i]), 2)
        for i in range(tensors)
    ]


def tiny_transformer_pairs(lr: float, seed: int) -> list[Pair]:
    """bf16 weights of a small transformer before and after one real Adam step."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Embedding(4096, 384),
        torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(384, 6, 1536, batch_first=True), num_layers=6
        ),
        torch.nn.Linear(384, 4096),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    tokens = torch.randint(0, 4096, (8, 128))
    for _ in range(3):  # warm Adam's moments so the measured step is not the first
        optimizer.zero_grad()
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.reshape(-1, 4096), tokens.reshape(-1)).backward()
        optimizer.step()
    before = {
        n: tensor_bytes(n, p.detach().to(torch.bfloat16)).copy()
        for n, p in model.named_parameters()
    }
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(
        model(tokens).reshape(-1, 4096), tokens.reshape(-1)
    ).backward()
    optimizer.step()
    after = {n: tensor_bytes(n, p.detach().to(torch.bfloat16)) for n, p in model.named_parameters()}
    return [(n, before[n], after[n], 2) for n in before]


def _timed(
    pool: cf.ThreadPoolExecutor, work: Callable[[Pair], Any], pairs: list[Pair]
) -> tuple[float, list[Any]]:
    begun = time.perf_counter()
    results = list(pool.map(work, pairs))
    return time.perf_counter() - begun, results


def measure(
    name: str, pairs: list[Pair], pool: cf.ThreadPoolExecutor, repeat: int, itemsize_blind: bool
) -> tuple[int, float, float]:
    """(wire bytes, best encode s, best apply s) of one encoding over every changed tensor."""
    encoding = ENCODINGS[name]
    kwargs: Callable[[int], dict[str, int]] = (
        (lambda size: {})
        if name in ("xor", "overwrite")
        else (lambda size: {"itemsize": 1 if itemsize_blind else size})
    )

    def encode(pair: Pair) -> bytes | None:
        _, old, new, size = pair
        delta = encoding.encode(old, new, **kwargs(size))
        return compress(delta.payload) if delta.changed_bytes else None

    encode_s, frames = min((_timed(pool, encode, pairs) for _ in range(repeat)), key=lambda r: r[0])
    changed = [(pair, frame) for pair, frame in zip(pairs, frames) if frame is not None]

    def apply(item: tuple[Pair, bytes, np.ndarray]) -> None:
        (tensor, _, _, _), frame, target = item
        payload = decompress(frame, max_size=encoding.max_payload_size(target.size), what=tensor)
        encoding.apply(target, payload, tensor=tensor)

    best_apply = float("inf")
    for _ in range(repeat):
        work = [(pair, frame, pair[1].copy()) for pair, frame in changed]
        begun = time.perf_counter()
        list(pool.map(apply, work))
        best_apply = min(best_apply, time.perf_counter() - begun)
        for (tensor, _, new, _), _, target in work:
            if not np.array_equal(target, new):
                raise AssertionError(f"{name}: {tensor} did not round-trip")
    return sum(len(f) for _, f in changed), encode_s, best_apply


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.model == "synthetic":
        pairs = synthetic_pairs(args.size, args.lr, args.seed)
    elif args.model == "moe":
        pairs = moe_pairs(args.tensors, args.lr, args.seed)
    else:
        pairs = tiny_transformer_pairs(args.lr, args.seed)
    total = sum(old.size for _, old, _, _ in pairs)
    elements = sum(old.size // size for _, old, _, size in pairs)
    changed = sum(
        int(np.count_nonzero(old.view("<u2") != new.view("<u2"))) for _, old, new, _ in pairs
    )
    rows: dict[str, tuple[int, float, float]] = {}
    with cf.ThreadPoolExecutor(args.threads) as pool:
        for name in args.encodings:
            blind = name.endswith(":bytes")
            rows[name] = measure(name.removesuffix(":bytes"), pairs, pool, args.repeat, blind)
    base_wire, base_encode, base_apply = rows["xor"]
    table = [
        Row(
            name,
            wire,
            100 * wire / total,
            wire / base_wire,
            enc,
            enc / base_encode,
            app,
            app / base_apply,
        )
        for name, (wire, enc, app) in rows.items()
    ]
    return {
        "model": args.model,
        "model_bytes": total,
        "tensors": len(pairs),
        "element_density": changed / elements,
        "threads": args.threads,
        "rows": [asdict(r) for r in table],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", choices=["synthetic", "moe", "tiny-transformer"], default="synthetic")
    p.add_argument("--tensors", type=int, default=8000, help="expert tensors of 64 KB (moe)")
    p.add_argument("--size", type=float, default=512, help="synthetic model size in MB")
    p.add_argument(
        "--lr", type=float, default=6.5e-8, help="per-element step (synthetic) or Adam lr"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument(
        "--encodings",
        nargs="+",
        default=["xor", "sparse-v2", "sparse-v2:bytes", "auto"],
        help="names; NAME:bytes codes with the dtype-blind element size 1",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if "xor" not in args.encodings:
        args.encodings.insert(0, "xor")
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{result['model']}: {result['tensors']} tensors, {result['model_bytes'] / 1e6:.1f} MB, "
        f"element density {100 * result['element_density']:.3f} %, {result['threads']} threads"
    )
    print(
        f"{'encoding':<18}{'wire %':>9}{'wire/xor':>10}{'encode s':>10}{'enc/xor':>9}"
        f"{'apply s':>9}{'app/xor':>9}"
    )
    for r in result["rows"]:
        print(
            f"{r['encoding']:<18}{r['wire_pct_of_model']:>9.3f}{r['wire_vs_xor']:>10.3f}"
            f"{r['encode_s']:>10.3f}{r['encode_vs_xor']:>9.2f}{r['apply_s']:>9.3f}{r['apply_vs_xor']:>9.2f}"
        )


if __name__ == "__main__":
    main()
