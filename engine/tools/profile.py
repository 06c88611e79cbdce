"""`python -m engine profile MODEL`: where a decode step's time goes, launch by launch, on the CUDA backend.

Each launch of one decode step (the model's forward for one token, the LM head and greedy decode's argmax, as
decode_chain's graph holds them; before 2026-12-05 the argmax was left out) is captured in a graph of its own and
replayed many times between device events, so its figure excludes the host; the whole step is replayed the same way.
With --batch N (N > 1) the same for the forward of N tokens as a prompt chunk runs (the launches of system1 and of a
short prefill: small-batch matmuls, prefill attention) and the LM head of its last row. The table groups launches by
kernel. The state the step reads (KV cache rows, position) comes from a real prompt run first; replaying a launch alone
rewrites its outputs with the same values, so nothing drifts.

A launch alone pays a graph launch of its own (a few microseconds), and in the step it overlaps its neighbours
(programmatic dependent launch), so its figure is not what it costs the step. With ablate, each kernel's cost in the
step is measured too: the step's time minus the time of the step without that kernel's launches (the outputs are
then wrong; only the time is read), the two replayed in turns.
"""

from __future__ import annotations

from engine.cuda import memory
from engine.errors import UnsupportedArchitecture


def replay_ms(launches: list, stream: int, repeats: int) -> float:
    """Mean device time of one replay of `launches`, captured as one graph (ms)."""
    graph = memory.Graph(stream)
    with graph:
        for launch in launches:
            launch(stream)
    try:
        graph.launch()  # warm-up: first replay uploads the graph
        memory.synchronize(stream)
        timer = memory.Timer(stream)
        timer.start()
        for _ in range(repeats):
            graph.launch()
        return timer.stop() / repeats
    finally:
        graph.destroy()


def in_step(launches: list, stream: int, repeats: int, rounds: int = 3) -> list[dict]:
    """Per kernel name, what its launches cost the step: the median over `rounds` of (step - step without them)."""
    names = sorted({launch.name for launch in launches})
    deltas: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        for name in names:
            full = replay_ms(launches, stream, repeats)
            rest = replay_ms([launch for launch in launches if launch.name != name], stream, repeats)
            deltas[name].append(full - rest)
    rows = []
    for name in names:
        d = sorted(deltas[name])[len(deltas[name]) // 2] * 1000.0
        count = sum(1 for launch in launches if launch.name == name)
        rows.append({"kernel": name, "launches": count, "us": round(d, 2), "us_a_launch": round(d / count, 2)})
    return sorted(rows, key=lambda r: -r["us"])


def profile(engine, prompt_tokens: int = 64, repeats: int = 200, ablate: bool = False, batch: int = 1) -> dict:
    """The decode step of `engine` (CUDA backend) after a prompt of `prompt_tokens` tokens, or the forward of `batch`
    tokens there, timed per launch (and, with ablate, per kernel in the step: in_step)."""
    runner = engine.runner
    if runner.backend != "cuda":
        raise UnsupportedArchitecture("profile needs the CUDA backend (a GPU and built kernels)")
    runner.reset()
    ids = [i % engine.config.n_vocab for i in range(1, prompt_tokens + 1)]
    runner.forward(ids, out="none")
    if batch == 1:
        launches = runner.decode_launches(ids[-1])
    else:
        launches = runner.batch_launches([(prompt_tokens + 1 + i) % engine.config.n_vocab for i in range(batch)])
    stream = runner.stream
    step_ms = replay_ms(launches, stream, repeats)
    rows = []
    for i, launch in enumerate(launches):
        us = replay_ms([launch], stream, repeats) * 1000.0
        rows.append({"i": i, "kernel": launch.name, "grid": list(launch.grid), "block": list(launch.block),
                     "us": round(us, 2)})  # fmt: skip
    by_kernel: dict[str, dict] = {}
    for row in rows:
        k = by_kernel.setdefault(row["kernel"], {"kernel": row["kernel"], "launches": 0, "us": 0.0})
        k["launches"] += 1
        k["us"] += row["us"]
    total_us = sum(r["us"] for r in rows) or 1.0
    table = sorted(by_kernel.values(), key=lambda k: -k["us"])
    for k in table:
        k["us"] = round(k["us"], 2)
        k["share"] = round(k["us"] / total_us, 4)
    report = {
        "model": engine.model_info,
        "prompt_tokens": prompt_tokens,
        "batch": batch,
        "repeats": repeats,
        "launches_per_step": len(launches),
        "step_ms": round(step_ms, 4),
        "tokens_per_s": round(batch * 1000.0 / step_ms, 1) if step_ms > 0 else None,
        "sum_of_launches_ms": round(total_us / 1000.0, 4),
        "weight_gb_per_s": round(engine.bytes_per_token / (step_ms * 1e6), 1) if step_ms > 0 else None,
        "by_kernel": table,
        "launches": rows,
    }
    if ablate:
        report["in_step"] = in_step(launches, stream, repeats)
    return report
