"""Draw a bench report (engine/tools/bench.py, with or without a peer) to an .svg or .png file, with matplotlib.

Left: the cold first result as stacked phases, p50 of the fresh processes: ours for system1 and generate (the
phases each process records, then what its outside wall clock saw beyond them: interpreter exit and teardown), the
peer's from its own log (load, prompt eval, eval; the rest of its wall clock as process start and exit). Right:
warm decode (tg128) and prefill (pp512) tokens/s, ours beside the peer's with flash attention off and on.
"""

from __future__ import annotations

# Ours: phases on the main thread's path to the first result, in the order they happen (engine.timing.ColdStart
# names), each less the phases named after it that it contains (model_load_ms holds the waits for the context thread).
OUR_PHASES = [("imports_ms", "imports", ()), ("gguf_open_ms", "GGUF + tokenizer", ()),
              ("cuda_init_wait_ms", "CUDA context wait", ()), ("early_upload_wait_ms", "early upload wait", ()),
              ("model_load_ms", "model load", ("cuda_init_wait_ms", "early_upload_wait_ms")),
              ("prompt_eval_ms", "prompt eval", ())]  # fmt: skip
PEER_PHASES = [("load_ms", "load", ()), ("prompt_eval_ms", "prompt eval", ()), ("eval_ms", "eval", ())]


def _bars(cold: dict, phases: list[tuple[str, str, tuple[str, ...]]]) -> list[tuple[str, float]]:
    """(label, ms) segments whose sum is the outside wall clock's p50."""
    wall = cold["external_wall_ms"]["p50"]
    out = [(label, max(0.0, cold[k]["p50"] - sum(cold[m]["p50"] for m in inside if m in cold)))
           for k, label, inside in phases if k in cold]  # fmt: skip
    for key in ("process_start_to_result_ms", "process_start_to_first_token_ms"):  # the process's own clock
        if key in cold:
            out.append(("other (in process)", max(0.0, cold[key]["p50"] - sum(ms for _, ms in out))))
            break
    out.append(("start + exit (outside)", max(0.0, wall - sum(ms for _, ms in out))))
    return out


def draw(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, *right) = plt.subplots(1, 3, figsize=(15, 4.8), gridspec_kw={"width_ratios": [3, 1, 1]})
    rows: list[tuple[str, list[tuple[str, float]]]] = []
    for job in ("system1", "generate"):
        if job in report.get("cold", {}):
            rows.append((f"ours: {job}", _bars(report["cold"][job], OUR_PHASES)))
    peer = report.get("peer")
    if peer and peer.get("cold"):
        rows.append((f"{peer['name']}: llama-simple -n 1", _bars(peer["cold"], PEER_PHASES)))
    palette = plt.get_cmap("tab10").colors
    colors: dict[str, tuple] = {}
    for y, (_, segments) in enumerate(rows):
        x = 0.0
        for label, ms in segments:
            new = label not in colors
            color = colors.setdefault(label, palette[len(colors) % len(palette)])
            left.barh(y, ms, left=x, color=color, label=label if new else None)
            x += ms
        left.text(x, y, f" {x:.0f} ms", va="center")
    left.set_yticks(range(len(rows)), [name for name, _ in rows])
    left.invert_yaxis()
    left.set_xlabel("ms from process spawn (p50 of fresh processes)")
    left.set_title("cold first result")
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=4, frameon=False)

    warm = report["warm"]
    for ax, (title, ours_key, test) in zip(right, (("decode", "decode", "tg128"), ("prefill", "prefill_512", "pp512")),
                                           strict=True):  # fmt: skip
        bars = [("ours", warm[ours_key]["tokens_per_s"])] if ours_key in warm else []
        for fa, got in (peer or {}).get("warm", {}).items():
            if test in got:
                bars.append((f"{peer['name']}\nFA {'on' if fa == 'fa1' else 'off'}", got[test]["tokens_per_s"]))
        for j, (_, value) in enumerate(bars):
            ax.bar(j, value, 0.7, color=palette[j % len(palette)])
            ax.text(j, value, f"{value:,.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
        ax.set_title(f"{title} {test}, tokens/s")
    device = report.get("device", {}).get("name", report.get("backend", ""))
    fig.suptitle(f"{report['model']} — {device} — {report['date']}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
