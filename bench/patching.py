"""Activation patching of every head on the embedded model: batched exact patching and attribution
patching against one forward pass per head.

Denoises each head's output z (30 layers × 9 heads = 270) of SmolLM2-135M on an IOI-style name swap
(``--tokens`` pads both prompts with the same leading text to a longer length), with the normalised
logit difference (:func:`headscope.analysis.patching.activation_patching`):

- ``loop``: one forward pass per head with a plain TransformerLens hook, full logits — the baseline,
  what a notebook does;
- ``batch B``: :func:`~headscope.analysis.patching.activation_patching`, B heads per forward pass, layers below
  a batch's first patched layer shared, only the last position unembedded;
- ``attribution``: attribution patching, one forward and one backward pass (plus the clean run's
  activations), with its agreement to the exact map.

Parity before timing: every case's map is compared with the loop's (max |Δ|). Each case runs in a
fresh process (peak MB is its own growth of peak RSS over the loaded model), with ``--threads``
torch threads. Prints one table.

    .venv/bin/python bench/patching.py [--tokens 14] [--batches 9,64] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
PAD = ("It was a quiet morning in the small town, and the shops along the main street were just opening. "
       "People walked slowly, talking about the weather and the news of the week. ") * 40

CASE = r"""
import json, resource, sys, time
import numpy as np, torch
from transformer_lens.utilities import get_act_name
from headscope.analysis.models import load_model
from headscope.analysis.patching import activation_patching, prompt_pair
mode, batch, tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
clean, corrupted, pad = sys.argv[5], sys.argv[6], sys.argv[7]
torch.set_num_threads(threads)
m = load_model("smollm2-135m")
n0 = len(m.encode(clean))
prefix = m.encode(pad)[: max(0, tokens - n0)]
clean_ids, corr_ids = prefix + m.encode(clean), prefix + m.encode(corrupted)
pair = prompt_pair(m, clean_ids, corr_ids, [" Mary", " John"])
A, B = pair.answers
def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
def ld(ids, hooks=()):
    with torch.inference_mode():
        x = m.bridge.run_with_hooks(torch.tensor([ids]), fwd_hooks=list(hooks), return_type="logits")[0, -1]
    return float(x[A] - x[B])
ld(clean_ids)  # warm-up
base = rss_mb()
t = time.perf_counter()
out = {}
if mode == "loop":
    zs = {}
    def keep(z, hook):
        zs[hook.layer()] = z[0].clone()
    with torch.inference_mode():
        m.bridge.run_with_hooks(torch.tensor([clean_ids]), fwd_hooks=[(get_act_name("z", la), keep)
                                for la in range(m.n_layers)], return_type=None)
    lc, lk = ld(clean_ids), ld(corr_ids)
    values = np.zeros((m.n_layers, m.n_heads))
    for la in range(m.n_layers):
        for h in range(m.n_heads):
            def patch(z, hook, la=la, h=h):
                z = z.clone(); z[0, :, h] = zs[la][:, h]; return z
            values[la, h] = (ld(corr_ids, [(get_act_name("z", la), patch)]) - lk) / (lc - lk)
elif mode == "batch":
    r = activation_patching(m, clean_ids, corr_ids, [" Mary", " John"], site="z", batch_size=batch)
    values = r.values
else:
    r = activation_patching(m, clean_ids, corr_ids, [" Mary", " John"], site="z", attribution=True, exact=False)
    values = r.attribution
wall = time.perf_counter() - t
print(json.dumps({"wall": wall, "peak_mb": rss_mb() - base, "values": np.asarray(values).tolist(),
                  "tokens": len(clean_ids)}))
"""


def measure(mode: str, batch: int, tokens: int, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([sys.executable, "-c", CASE, mode, str(batch), str(tokens), str(threads), CLEAN, CORRUPTED,
                          PAD], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=14, help="prompt length (14: the bare IOI pair)")
    parser.add_argument("--batches", default="9,64", help="heads per forward pass for the batched cases")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import numpy as np
    from scipy.stats import pearsonr, spearmanr

    loop = measure("loop", 1, args.tokens, args.threads)
    ref = np.array(loop["values"])
    print(f"activation patching of every head's z (denoising, 270 heads), {loop['tokens']} tokens, "
          f"{args.threads} torch thread(s)")
    print(f"{'case':<28} | {'wall s':>7} | {'× loop':>7} | {'peak MB':>7} | {'max |Δ| vs loop':>15} | agreement")
    print("-" * 100)
    print(f"{'loop (1 forward per head)':<28} | {loop['wall']:>7.2f} | {1.0:>7.2f} | {loop['peak_mb']:>7.0f} | "
          f"{0.0:>15.1e} |", flush=True)
    cases = [("batch", int(b)) for b in args.batches.split(",") if b.strip()] + [("attribution", 1)]
    for mode, batch in cases:
        r = measure(mode, batch, args.tokens, args.threads)
        values = np.array(r["values"])
        name = f"exact, batch {batch}" if mode == "batch" else "attribution (1 fwd + 1 bwd)"
        diff = float(np.abs(values - ref).max())
        note = ""
        if mode == "attribution":
            top = set(np.argsort(-np.abs(ref).ravel())[:10]) & set(np.argsort(-np.abs(values).ravel())[:10])
            note = (f"Pearson {pearsonr(ref.ravel(), values.ravel())[0]:.3f}, Spearman "
                    f"{spearmanr(ref.ravel(), values.ravel())[0]:.3f}, top-10 overlap {len(top) / 10:.0%}")
        print(f"{name:<28} | {r['wall']:>7.2f} | {r['wall'] / loop['wall']:>7.3f} | {r['peak_mb']:>7.0f} | "
              f"{diff:>15.1e} | {note}", flush=True)
    print("\n× loop = wall time over the loop's, same prompt, each case in its own process after a warm-up "
          "forward pass;\nmax |Δ| = largest difference of the normalised map from the loop's (for attribution: "
          "the first-order error, not a bug).")


if __name__ == "__main__":
    main()
