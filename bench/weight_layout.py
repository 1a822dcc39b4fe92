"""Side-by-side timing of matmul weight layouts for the Llama decoder's projections.

Compares, in one process and alternating call by call, a jitted ``lax.scan`` over L layers
(rms_norm, qkv projection, output projection, gated MLP; attention replaced by q itself, as
bench/step_breakdown.py's "layers without attention") for these weight layouts:

- ``in_out``:  [in, out] weights (wqkv [L, D, Hkv, G+2, hd], wo [L, Hkv, G, hd, D],
  w_gate_up [L, D, 2, F], w_down [L, F, D]), the layout before weights became [out, in];
- ``out_in_einsum``: [out, in] weights (HF nn.Linear orientation: wqkv [L, Hkv, G+2, hd, D],
  wo [L, D, Hkv, G, hd], w_gate_up [L, 2, F, D], w_down [L, D, F]), multi-axis einsums
  ("td,kghd->tkgh", "tkgh,dkgh->td", "td,cfd->tcf", "tf,df->td");
- ``out_in``: the same [out, in] arrays reshaped (free) to 2-D inside the step and used as
  2-D dots contracting the weight's last axis (``x @ w.T``), gate and up as two dots of
  [F, D] each: the form models/llama.py uses.

plus the untied lm_head alone ([D, V] vs [V, D]). Defaults are SmolLM2-135M's shapes in
float32. Prints the best of ``--repeats`` calls (ms) per layout and row count M.

    python bench/weight_layout.py [--rows 1 8 32 128] [--repeats 7]

Measured on the 2-core CPU dev machine (jax 0.10.2, load average ~1.7 from other work), ms:

        M   in_out   out_in   out_in_einsum   lm_head in_out   lm_head out_in
        1     55.4     31.2           148.2              5.5              6.5
        8    134.1    109.3           194.1             27.9             17.4
       32    171.2    133.3           235.8             53.9             28.5
      128    269.3    288.2           353.7             63.5             62.2
      512    929.7    938.0          1018.8            304.1            305.6  (best of 5)

The multi-axis einsums on [out, in] weights are the slowest (XLA:CPU copies the weight);
the same arrays as 2-D dots win 20-45% for decode-sized M and are within noise beyond.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def _rms(x, w):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(x.dtype) * w


def _layer_fn(layout: str, hkv: int, g: int, hd: int):
    def layer(x, lp):
        t, d = x.shape
        h = _rms(x, lp["attn_norm"])
        if layout == "in_out":
            qkv = jnp.einsum("td,dkgh->tkgh", h, lp["wqkv"])
        elif layout == "out_in_einsum":
            qkv = jnp.einsum("td,kghd->tkgh", h, lp["wqkv"])
        else:
            qkv = (h @ lp["wqkv"].reshape(-1, d).T).reshape(t, hkv, g + 2, hd)
        attn = qkv[:, :, :g] * qkv[:, :, g : g + 1] + qkv[:, :, g + 1 : g + 2]  # for attention
        if layout == "in_out":
            x = x + jnp.einsum("tkgh,kghd->td", attn, lp["wo"])
        elif layout == "out_in_einsum":
            x = x + jnp.einsum("tkgh,dkgh->td", attn, lp["wo"])
        else:
            x = x + attn.reshape(t, -1) @ lp["wo"].reshape(d, -1).T
        h = _rms(x, lp["mlp_norm"])
        if layout == "in_out":
            gu = jnp.einsum("td,dcf->tcf", h, lp["w_gate_up"])
            gate, up = gu[:, 0], gu[:, 1]
        elif layout == "out_in_einsum":
            gu = jnp.einsum("td,cfd->tcf", h, lp["w_gate_up"])
            gate, up = gu[:, 0], gu[:, 1]
        else:
            gate, up = h @ lp["w_gate_up"][0].T, h @ lp["w_gate_up"][1].T
        act = jax.nn.silu(gate) * up
        if layout == "in_out":
            x = x + act @ lp["w_down"]
        elif layout == "out_in_einsum":
            x = x + jnp.einsum("tf,df->td", act, lp["w_down"])
        else:
            x = x + act @ lp["w_down"].T
        return x, None

    return layer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--queries-per-kv", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=49152)
    a = p.parse_args()
    L, d, hkv, g, hd, f, v = (
        a.layers, a.hidden, a.kv_heads, a.queries_per_kv, a.head_dim, a.intermediate, a.vocab,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    rnd = lambda *s: rng.standard_normal(s, dtype=np.float32) * 0.02
    # One set of weights in the [out, in] layout; the [in, out] arrays are its transposes.
    out_in = {
        "attn_norm": np.ones((L, d), np.float32),
        "mlp_norm": np.ones((L, d), np.float32),
        "wqkv": rnd(L, hkv, g + 2, hd, d),
        "wo": rnd(L, d, hkv, g, hd),
        "w_gate_up": rnd(L, 2, f, d),
        "w_down": rnd(L, d, f),
    }
    in_out = dict(
        out_in,
        wqkv=np.moveaxis(out_in["wqkv"], 4, 1),
        wo=np.moveaxis(out_in["wo"], 1, 4),
        w_gate_up=np.moveaxis(out_in["w_gate_up"], 3, 1),
        w_down=np.swapaxes(out_in["w_down"], 1, 2),
    )
    weights = {
        "in_out": jax.device_put({k: np.ascontiguousarray(w) for k, w in in_out.items()}),
        "out_in": jax.device_put(out_in),
    }
    weights["out_in_einsum"] = weights["out_in"]
    lm_vd = rnd(v, d)
    lm = {"in_out": jax.device_put(np.ascontiguousarray(lm_vd.T)), "out_in": jax.device_put(lm_vd)}

    def make(layout):
        layer = _layer_fn(layout, hkv, g, hd)
        return jax.jit(lambda lp, x: jax.lax.scan(layer, x, lp)[0])

    fns = {k: make(k) for k in weights}
    heads = {
        "in_out": jax.jit(lambda w, x: jnp.einsum("td,dv->tv", x, w)),
        "out_in": jax.jit(lambda w, x: jnp.einsum("td,vd->tv", x, w)),
    }

    def best(calls):
        times = {k: float("inf") for k in calls}
        for fn, args in calls.values():
            jax.block_until_ready(fn(*args))  # compile + warm
        for _ in range(a.repeats):
            for k, (fn, args) in calls.items():  # alternate the layouts call by call
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[k] = min(times[k], time.perf_counter() - t0)
        return times

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; L={L} D={d} Hkv={hkv} G={g} "
          f"hd={hd} F={f} V={v} float32, best of {a.repeats} (ms)")  # fmt: skip
    cols = list(fns) + [f"lm_head {k}" for k in heads]
    print(f"{'M':>5} " + " ".join(f"{c:>16}" for c in cols) + f" {'out_in/in_out':>14}")
    for m in a.rows:
        x = jnp.asarray(rng.standard_normal((m, d), dtype=np.float32))
        t = best({k: (fn, (weights[k], x)) for k, fn in fns.items()})
        t_head = best({k: (fn, (lm[k], x)) for k, fn in heads.items()})
        t.update({f"lm_head {k}": v for k, v in t_head.items()})
        row = " ".join(f"{t[c] * 1e3:16.2f}" for c in cols)
        print(f"{m:>5} {row} {t['out_in'] / t['in_out']:14.2f}", flush=True)


if __name__ == "__main__":
    main()
