"""What the daemon's output path costs a token, in CPU time, without an engine or HTTP.

    python -m bench.daemon.output_path [--seqs 64] [--tokens 1024] [--rounds 5] [--json FILE]
                                [--tree LABEL=DIR ...]

`bench.daemon.output_share` samples the output path inside a running daemon: the right question,
but the answer moves by half between sittings on a 2-core box, where the engine's threads
and the load generator share the cores with the daemon. This benchmark times the same code
alone, in one thread of a quiet process, so that a change to it shows within a few percent:

- *core*: the scheduler's side, `Sequence.append_token` for `--seqs` streamed sequences and
  `--tokens` tokens each (stop checks, the served tokenizer's incremental detokenizer, the
  `SequenceDelta`), on the demo model's tokenizer and the token ids of this repository's
  docs/architecture.md;
- *event loop*: each step's deltas handed to their requests (`StepLoopClient._dispatch`),
  each request's task woken, its delta through `generate`, `Serving`'s accounting and
  `stream_chunks` to the SSE bytes of a completion chunk (what the HTTP layer then sends).

The figures are the best of `--rounds` (the least disturbed run), in microseconds a token.
`--tree LABEL=DIR` (repeatable) times each source tree in turn (a checkout of an older
commit: the "before"), each in its own process, with this file's driver.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def measure(seqs: int, tokens: int, text: str) -> dict[str, float]:
    """One run in this process (the tree on sys.path): core and event-loop us a token."""
    from engine.core.engine_args import EngineArgs
    from engine.core.model_files import DEMO_MODEL, resolve_model_dir
    from engine.core.sampling_params import SamplingParams
    from engine.core.sequence import Sequence
    from engine.core.tokenizer import Tokenizer
    from engine.runtime.step_loop_client import StepLoopClient
    from server.openai.endpoints.completions import CompletionServing
    from server.openai.endpoints.prepared import Prepared
    from server.openai.metrics import Metrics
    from server.openai.streaming import stream_chunks

    model_dir = resolve_model_dir(DEMO_MODEL)
    tokenizer = Tokenizer(model_dir)
    ids = (tokenizer.encode(text, False) * (1 + tokens))[:tokens]
    client = StepLoopClient(EngineArgs(model=DEMO_MODEL), model_dir=model_dir, model_name="m")
    client._tokenizer = tokenizer  # what start() reads; no engine process is started
    client._executor = type("Alive", (), {"is_alive": True})()
    client._ready.set()
    serving = CompletionServing(client, "m", Metrics(client))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)

    async def run() -> dict[str, float]:
        client._loop = asyncio.get_running_loop()
        chunks = [0]

        async def request(i: int) -> None:
            prep = Prepared(
                False, f"r{i}", 0, "m", [[1, 2, 3]], [params], 1, False, None, True, True
            )
            async for _ in stream_chunks(serving, prep, 0):
                chunks[0] += 1

        tasks = [asyncio.create_task(request(i)) for i in range(seqs)]
        await asyncio.sleep(0)  # each request puts its "add" command
        sequences: list[Sequence] = []
        while len(sequences) < seqs:
            _, (children, reply) = client._commands.get_nowait()
            sequences += [Sequence.from_request(c, len(sequences), tokenizer) for c in children]
            reply.set_result(None)
        await asyncio.sleep(0.01)
        core = 0.0
        start = time.perf_counter()
        for token_id in ids:
            began = time.perf_counter()
            deltas = [s.append_token(token_id, None, (), 1 << 30) for s in sequences]
            core += time.perf_counter() - began
            sent = chunks[0] + len(deltas)
            client._dispatch([d for d in deltas if d is not None])
            for _ in range(100 * seqs):  # until every request's task has sent its chunk
                if chunks[0] >= sent:
                    break
                await asyncio.sleep(0)
            else:
                raise RuntimeError(f"{sent - chunks[0]} deltas sent no chunk")
        total = time.perf_counter() - start
        await asyncio.gather(*tasks)
        n = seqs * tokens
        return {"core_us": 1e6 * core / n, "event_loop_us": 1e6 * (total - core) / n}

    return asyncio.run(run())


def child(args: argparse.Namespace) -> int:
    text = (REPO / "docs" / "architecture.md").read_text()
    runs = [measure(args.seqs, args.tokens, text) for _ in range(args.rounds)]
    best = {k: min(r[k] for r in runs) for k in runs[0]}
    print(json.dumps({**best, "total_us": best["core_us"] + best["event_loop_us"]}))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    from bench.common import Table, source_trees, write_json
    from bench.subproc import run_child

    trees = source_trees(args.tree, REPO)
    table = Table(["tree", "core, us a token", "event loop, us a token", "total, us a token"])
    results: list[dict[str, Any]] = []
    for label, tree in trees:
        flags = ["--seqs", str(args.seqs), "--tokens", str(args.tokens)]
        with tempfile.TemporaryDirectory(prefix="nanoflex-output-path-") as tmp:
            ran = run_child(
                ["-P", __file__, "--child", *flags, "--rounds", str(args.rounds)],
                timeout_s=1800,
                log_path=Path(tmp) / "child.log",
                env={"PYTHONPATH": str(Path(tree).resolve())},
            )
        if ran.returncode != 0:
            raise SystemExit(f"{label}: the run failed:\n{ran.output[-3000:]}")
        result = {"tree": label, **json.loads(ran.output.splitlines()[-1])}
        results.append(result)
        print(json.dumps(result), file=sys.stderr)
        figures = [result[k] for k in ("core_us", "event_loop_us", "total_us")]
        table.rows.append([label, *(f"{v:.2f}" for v in figures)])
    print(table.markdown("lrrr"))
    config = {"seqs": args.seqs, "tokens": args.tokens, "rounds": args.rounds, "trees": trees}
    write_json(args.json, [{"config": config, "runs": results}], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
