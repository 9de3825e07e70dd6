#!/usr/bin/env python3
"""Independent float64 NumPy reference for the kvc llama engine (SmolLM2-135M GGUF).

What it does
  * loads the GGUF with gguf.GGUFReader, dequantises every tensor with
    gguf.quants.dequantize (the same Q4_1/Q8_0 -> float values the C++ engine uses);
  * builds a byte-level BPE tokenizer with HF `tokenizers` from the GGUF vocab and
    merges (Digits(individual) + ByteLevel(GPT-2 regex) pre-tokenizer, no BOS);
  * runs a float64 llama forward pass with exact causal attention over the
    first N tokens of the text, all positions at once;
  * optionally checks the C++ engine's token ids and logits against it.

Conventions (what the C++ engine must match)
  * weights: W has shape [out, in] (GGUF ne0 = in), y = W @ x.
  * RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, eps = llama.attention.layer_norm_rms_epsilon.
  * attention: q = Wq h, k = Wk h, v = Wv h (no biases); head h of q uses kv head
    h // (n_head / n_head_kv); RoPE on q and k in GGUF row order rotates ADJACENT
    pairs (x[2i], x[2i+1]) by angle pos * theta^(-2i/head_dim), pos starting at 0;
    scores = q.k / sqrt(head_dim), causal softmax, out = Wo (concat heads).
  * FFN: down( silu(gate h) * up h ), silu(x) = x / (1 + exp(-x)).
  * residual: x += attn(norm(x)); x += ffn(norm(x)); logits = token_embd @ norm_out(x)
    (tied embeddings, no output.weight).
  * perplexity over N tokens = exp(mean over t=0..N-2 of -log p(tok[t+1] | tok[0..t])),
    i.e. N-1 predictions, no BOS prepended.

Exit code: 0 when every requested check passes, 1 otherwise, 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

# Single-threaded BLAS unless the caller says otherwise (shared machines).
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import numpy as np  # noqa: E402


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------
# Model loading
# ----------------------------------------------------------------------------

class Model:
    def __init__(self, path: str):
        from gguf import GGUFReader

        self.reader = GGUFReader(path)
        self.tensors = {t.name: t for t in self.reader.tensors}
        f = self.reader.fields

        def get(key):
            if key not in f:
                raise KeyError(f"GGUF metadata key missing: {key}")
            return f[key].contents()

        arch = get("general.architecture")
        if arch != "llama":
            raise ValueError(f"unsupported architecture {arch!r} (expected 'llama')")
        self.n_layer = int(get("llama.block_count"))
        self.d_model = int(get("llama.embedding_length"))
        self.n_ff = int(get("llama.feed_forward_length"))
        self.n_head = int(get("llama.attention.head_count"))
        self.n_head_kv = int(get("llama.attention.head_count_kv"))
        self.eps = float(get("llama.attention.layer_norm_rms_epsilon"))
        self.theta = float(get("llama.rope.freq_base"))
        self.head_dim = self.d_model // self.n_head
        if "llama.rope.dimension_count" in f:
            rd = int(get("llama.rope.dimension_count"))
            if rd != self.head_dim:
                raise ValueError(f"partial RoPE ({rd} of {self.head_dim}) not supported")
        if "rope_freqs.weight" in self.tensors:
            raise ValueError("rope_freqs.weight (RoPE scaling) not supported")
        self.tokens = list(get("tokenizer.ggml.tokens"))
        self.merges = list(get("tokenizer.ggml.merges"))
        self.vocab_size = len(self.tokens)
        self.tok_model = get("tokenizer.ggml.model")
        self.tok_pre = get("tokenizer.ggml.pre") if "tokenizer.ggml.pre" in f else None
        self.add_bos = bool(get("tokenizer.ggml.add_bos_token")) if "tokenizer.ggml.add_bos_token" in f else False

    def weight(self, name: str, dtype=np.float64) -> np.ndarray:
        """Dequantised tensor as [rows, row_len] (i.e. [out, in] for matrices)."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        w = dequantize(t.data, t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape))  # GGUF ne is innermost-first
        return np.ascontiguousarray(w.reshape(shape), dtype=dtype)


# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------

def build_tokenizer(model: Model):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    if model.tok_model != "gpt2":
        raise ValueError(f"tokenizer model {model.tok_model!r} not supported (expected gpt2)")
    if model.tok_pre not in (None, "smollm"):
        log(f"warning: pre-tokenizer {model.tok_pre!r}; using the smollm rules anyway")
    vocab = {tok: i for i, tok in enumerate(model.tokens)}
    merges = []
    for m in model.merges:
        a, b = m.split(" ", 1)
        merges.append((a, b))
    bpe = models.BPE(vocab, merges)
    tk = Tokenizer(bpe)
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    # Control tokens (<|endoftext|>, ...) are deliberately NOT registered as special
    # tokens: the text is tokenized as plain text, the way an engine that does not
    # parse special tokens sees it.
    return tk


def tokenize(tk, text: str, add_bos: bool, bos_id: int = 1) -> np.ndarray:
    ids = tk.encode(text, add_special_tokens=False).ids
    if add_bos:
        ids = [bos_id] + ids
    return np.asarray(ids, dtype=np.int32)


# ----------------------------------------------------------------------------
# Forward pass
# ----------------------------------------------------------------------------

def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


def rope_tables(n: int, head_dim: int, theta: float, dtype) -> tuple[np.ndarray, np.ndarray]:
    i = np.arange(head_dim // 2, dtype=np.float64)
    inv_freq = theta ** (-2.0 * i / head_dim)
    ang = np.arange(n, dtype=np.float64)[:, None] * inv_freq[None, :]  # [n, hd/2]
    return np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, mode: str) -> np.ndarray:
    """x: [n, heads, head_dim]; cos/sin: [n, head_dim/2]."""
    c = cos[:, None, :]
    s = sin[:, None, :]
    out = np.empty_like(x)
    if mode == "adjacent":      # pairs (2i, 2i+1): GGUF-permuted llama weights
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2] = a * c - b * s
        out[..., 1::2] = a * s + b * c
    elif mode == "halves":      # pairs (i, i+hd/2): HF "rotate_half" layout
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
        out[..., :h] = a * c - b * s
        out[..., h:] = a * s + b * c
    else:
        raise ValueError(mode)
    return out


def forward(model: Model, ids: np.ndarray, dtype=np.float64, rope_mode: str = "adjacent",
            q_block: int = 256, layer_hook=None) -> np.ndarray:
    """Logits [n, vocab] for every position of ids (exact causal attention)."""
    n = len(ids)
    hd, nh, nkv = model.head_dim, model.n_head, model.n_head_kv
    rep = nh // nkv
    emb = model.weight("token_embd.weight", dtype)          # [vocab, d]
    x = emb[ids].copy()                                      # [n, d]
    cos, sin = rope_tables(n, hd, model.theta, dtype)
    scale = dtype(1.0 / math.sqrt(hd))
    causal = np.triu(np.ones((n, n), dtype=bool), k=1)       # True = masked

    for L in range(model.n_layer):
        p = f"blk.{L}."
        h = rms_norm(x, model.weight(p + "attn_norm.weight", dtype), dtype(model.eps))
        q = (h @ model.weight(p + "attn_q.weight", dtype).T).reshape(n, nh, hd)
        k = (h @ model.weight(p + "attn_k.weight", dtype).T).reshape(n, nkv, hd)
        v = (h @ model.weight(p + "attn_v.weight", dtype).T).reshape(n, nkv, hd)
        q = apply_rope(q, cos, sin, rope_mode)
        k = apply_rope(k, cos, sin, rope_mode)
        if layer_hook is not None:
            layer_hook(L, k, v)
        # GQA: query head j uses kv head j // rep  -> [nkv, rep, n, hd]
        qg = q.transpose(1, 0, 2).reshape(nkv, rep, n, hd)
        kt = k.transpose(1, 2, 0)                            # [nkv, hd, n]
        vt = v.transpose(1, 0, 2)                            # [nkv, n, hd]
        att = np.empty((nkv, rep, n, hd), dtype=dtype)
        for s0 in range(0, n, q_block):
            s1 = min(n, s0 + q_block)
            sc = (qg[:, :, s0:s1, :] @ kt[:, None, :, :]) * scale   # [nkv, rep, b, n]
            sc = np.where(causal[None, None, s0:s1, :], -np.inf, sc)
            sc = sc - sc.max(axis=-1, keepdims=True)
            pr = np.exp(sc)
            pr /= pr.sum(axis=-1, keepdims=True)
            att[:, :, s0:s1, :] = pr @ vt[:, None, :, :]
        att = att.reshape(nh, n, hd).transpose(1, 0, 2).reshape(n, nh * hd)
        x = x + att @ model.weight(p + "attn_output.weight", dtype).T

        h = rms_norm(x, model.weight(p + "ffn_norm.weight", dtype), dtype(model.eps))
        g = h @ model.weight(p + "ffn_gate.weight", dtype).T
        u = h @ model.weight(p + "ffn_up.weight", dtype).T
        a = g / (1.0 + np.exp(-g)) * u
        x = x + a @ model.weight(p + "ffn_down.weight", dtype).T

    x = rms_norm(x, model.weight("output_norm.weight", dtype), dtype(model.eps))
    out_name = "output.weight" if "output.weight" in model.tensors else "token_embd.weight"
    w_out = emb if out_name == "token_embd.weight" else model.weight(out_name, dtype)
    return x @ w_out.T


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def perplexity(logits: np.ndarray, ids: np.ndarray) -> float:
    """exp(mean NLL) of ids[1:] given logits[:-1] (N-1 predictions)."""
    if len(ids) < 2:
        return float("nan")
    nll = []
    for s0 in range(0, len(ids) - 1, 256):   # chunks: bounded memory for long texts
        s1 = min(len(ids) - 1, s0 + 256)
        lp = log_softmax(logits[s0:s1])
        nll.append(-lp[np.arange(s1 - s0), ids[s0 + 1:s1 + 1]])
    return float(np.exp(np.concatenate(nll).mean()))


# ----------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------

def check_tokens(path: str, ref_ids: np.ndarray) -> bool:
    try:
        got = np.load(path)
    except (OSError, ValueError) as e:
        log(f"tokens: FAIL: cannot load {path}: {e}")
        return False
    if got.ndim != 1:
        log(f"tokens: FAIL: {path} has shape {got.shape}, expected 1-D")
        return False
    if got.dtype != np.int32:
        log(f"tokens: note: dtype {got.dtype} (expected int32), comparing values")
    m = len(got)
    if m > len(ref_ids):
        log(f"tokens: FAIL: engine has {m} tokens, reference only {len(ref_ids)} for the whole text")
        return False
    ref = ref_ids[:m]
    bad = np.nonzero(got.astype(np.int64) != ref.astype(np.int64))[0]
    if len(bad) == 0:
        what = "whole text" if m == len(ref_ids) else f"prefix of {len(ref_ids)}"
        log(f"tokens: PASS: {m} ids equal the reference ({what})")
        return True
    i = int(bad[0])
    lo, hi = max(0, i - 3), min(m, i + 4)
    log(f"tokens: FAIL: {len(bad)} of {m} ids differ; first mismatch at index {i}: "
        f"engine {int(got[i])} vs reference {int(ref[i])}")
    log(f"  reference [{lo}:{hi}]: {ref[lo:hi].tolist()}")
    log(f"  engine    [{lo}:{hi}]: {got[lo:hi].tolist()}")
    return False


def compare_logits(got: np.ndarray, ref: np.ndarray, atol: float, rtol: float,
                   label: str = "logits") -> bool:
    got = got.astype(np.float64)
    diff = np.abs(got - ref)
    tol = atol + rtol * np.abs(ref)
    max_abs = float(diff.max())
    rng = float(ref.max() - ref.min())
    worst = np.unravel_index(int(np.argmax(diff - tol)), diff.shape)
    within = bool(np.all(diff <= tol))
    am_ref, am_got = ref.argmax(-1), got.argmax(-1)
    agree = am_ref == am_got
    # A disagreement only counts where the reference top-2 margin is clearly larger
    # than the tolerance (near-ties may legitimately flip under fp32 rounding).
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    hard_bad = (~agree) & (margin > 2 * atol)
    ok = within and not hard_bad.any()
    log(f"{label}: max|diff| {max_abs:.3e} (at pos {worst[0]} tok {worst[1]}), "
        f"max|diff|/range {max_abs / rng:.3e} (range {rng:.2f}), "
        f"mean|diff| {float(diff.mean()):.3e}, argmax agree {int(agree.sum())}/{len(agree)}")
    if not agree.all():
        log(f"  argmax disagreements at positions {np.nonzero(~agree)[0].tolist()[:20]} "
            f"(ref top-2 margins {margin[~agree][:20].round(4).tolist()})")
    verdict = "PASS" if ok else "FAIL"
    log(f"{label}: {verdict}: atol {atol:g} rtol {rtol:g}; "
        f"{'all within tolerance' if within else 'elements outside tolerance'}; "
        f"{int(hard_bad.sum())} argmax disagreement(s) with margin > 2*atol")
    return ok


# ----------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description="Float64 NumPy reference for the kvc llama engine (tokens, logits, perplexity).")
    ap.add_argument("--model", required=True, help="GGUF file (SmolLM2-135M-Instruct.Q4_1.gguf)")
    ap.add_argument("--text", required=True, help="UTF-8 text file")
    ap.add_argument("--n", type=int, default=None,
                    help="tokens in the forward pass (default 32; with --logits-npy, its row count)")
    ap.add_argument("--ppl", type=int, default=None, metavar="N",
                    help="perplexity mode: forward over the first N tokens and print the float64 PPL")
    ap.add_argument("--tokens-npy", help="engine token ids (int32, 1-D) to check against the reference")
    ap.add_argument("--logits-npy", help="engine logits (float32 [n, vocab], exact cache) to compare")
    # Default atol 5e-3: this file's own float32 run differs from float64 by 5e-5 (n=32)
    # and 1.4e-4 (n=256) on logits spanning ~70; a real bug is far larger (RMSNorm eps
    # 1e-6 instead of 1e-5 already gives 4e-2, wrong RoPE pairing/theta gives 10+).
    ap.add_argument("--atol", type=float, default=5e-3,
                    help="absolute logit tolerance (default 5e-3, ~35x the fp32-vs-fp64 error)")
    ap.add_argument("--rtol", type=float, default=0.0, help="relative logit tolerance (default 0)")
    ap.add_argument("--write-tokens", help="write the reference ids of the WHOLE text (int32 .npy)")
    ap.add_argument("--write-logits", help="write the reference logits [n, vocab] (float32 .npy)")
    ap.add_argument("--show", type=int, default=0, metavar="K",
                    help="print the top-1 next-token prediction for the first K positions")
    ap.add_argument("--fp32-check", action="store_true",
                    help="also run this reference in float32 and report its distance to float64 "
                         "(what an fp32 engine can be expected to reach)")
    ap.add_argument("--engine-json", metavar="EVAL_JSON",
                    help="kvc-eval's JSON: check its exact-cache (baseline) PPL against this script's "
                         "float64 PPL over the same number of tokens (sets n to its 'tokens')")
    ap.add_argument("--ppl-atol", type=float, default=1e-3,
                    help="|engine exact-cache PPL - float64 PPL| allowed with --engine-json (default 1e-3)")
    ap.add_argument("--rope-mode", choices=["adjacent", "halves"], default="adjacent",
                    help="RoPE pairing in GGUF row order (default adjacent; 'halves' is wrong for "
                         "GGUF llama files and exists only to verify that)")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    model = Model(args.model)
    tk = build_tokenizer(model)
    with open(args.text, "rb") as fh:
        text = fh.read().decode("utf-8")
    ids = tokenize(tk, text, model.add_bos)
    log(f"model: {os.path.basename(args.model)}: {model.n_layer} layers, d {model.d_model}, "
        f"heads {model.n_head}/{model.n_head_kv} x {model.head_dim}, ff {model.n_ff}, "
        f"vocab {model.vocab_size}, eps {model.eps:g}, theta {model.theta:g}, rope {args.rope_mode}")
    log(f"text: {os.path.basename(args.text)}: {len(text.encode('utf-8'))} bytes, {len(ids)} tokens"
        f"{' (BOS prepended)' if model.add_bos else ''}")

    ok = True
    if args.write_tokens:
        np.save(args.write_tokens, ids.astype(np.int32))
        log(f"wrote {args.write_tokens}: {len(ids)} int32 ids")
    if args.tokens_npy:
        ok &= check_tokens(args.tokens_npy, ids)

    got_logits = None
    if args.logits_npy:
        try:
            got_logits = np.load(args.logits_npy)
        except (OSError, ValueError) as e:
            log(f"logits: FAIL: cannot load {args.logits_npy}: {e}")
            return 1
        if got_logits.ndim != 2 or got_logits.shape[1] != model.vocab_size:
            log(f"logits: FAIL: {args.logits_npy} has shape {got_logits.shape}, "
                f"expected [n, {model.vocab_size}]")
            return 1

    engine = None
    if args.engine_json:
        try:
            with open(args.engine_json) as fh:
                engine = json.load(fh)
            engine_ppl, engine_n = float(engine["baseline"]["ppl"]), int(engine["tokens"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log(f"ppl: FAIL: cannot read the baseline PPL from {args.engine_json}: {e}")
            return 1
    if engine is not None:
        n = engine_n
    elif args.ppl is not None:
        n = args.ppl
    elif args.n is not None:
        n = args.n
    elif got_logits is not None:
        n = got_logits.shape[0]
    else:
        n = 32
    if n < 1:
        log("error: n must be >= 1")
        return 2
    if n > len(ids):
        log(f"error: n = {n} but the text has only {len(ids)} tokens")
        return 2
    sub = ids[:n]

    t1 = time.perf_counter()
    logits = forward(model, sub, np.float64, args.rope_mode)
    t2 = time.perf_counter()
    ppl = perplexity(logits, sub)
    log(f"reference: float64 forward over {n} tokens in {t2 - t1:.2f} s (load+tokenize {t1 - t0:.2f} s)")
    log(f"reference PPL over the first {n} tokens ({n - 1} predictions): {ppl:.6f}")

    if args.show > 0:
        am = logits.argmax(-1)
        lp = log_softmax(logits)
        dec = lambda t: tk.decode([int(t)])  # noqa: E731
        log("pos  token -> predicted (p)        | actual next")
        for t in range(min(args.show, n)):
            nxt = repr(dec(ids[t + 1])) if t + 1 < len(ids) else "-"
            log(f"{t:4d} {dec(sub[t])!r:>14} -> {dec(am[t])!r:<14} ({math.exp(lp[t, am[t]]):.3f}) | {nxt}")
    if n > 1:
        top1 = float(np.mean(logits[:-1].argmax(-1) == sub[1:]))
        log(f"reference top-1 next-token accuracy over {n - 1} predictions: {top1:.4f}")

    if args.write_logits:
        np.save(args.write_logits, logits.astype(np.float32))
        log(f"wrote {args.write_logits}: float32 {logits.shape}")

    if args.fp32_check:
        t3 = time.perf_counter()
        l32 = forward(model, sub, np.float32, args.rope_mode)
        log(f"fp32 self-check: forward in {time.perf_counter() - t3:.2f} s, "
            f"PPL {perplexity(l32, sub):.6f}")
        compare_logits(l32, logits, args.atol, args.rtol, label="fp32-vs-fp64")

    if got_logits is not None:
        m = got_logits.shape[0]
        if m != n:
            log(f"logits: note: engine gave {m} rows, reference has {n}; comparing the first {min(m, n)}")
        k = min(m, n)
        ok &= compare_logits(got_logits[:k], logits[:k], args.atol, args.rtol)
        log(f"engine PPL over the same {k} tokens: {perplexity(got_logits[:k].astype(np.float64), sub[:k]):.6f}")

    if engine is not None:
        d = engine_ppl - ppl
        good = abs(d) < args.ppl_atol
        log(f"ppl: {'ok' if good else 'FAIL'}: engine exact-cache ({engine['baseline'].get('name', '?')}) PPL "
            f"{engine_ppl:.6f} - float64 PPL {ppl:.6f} = {d:+.2e} (|d| < {args.ppl_atol:g} required)")
        ok &= good

    checks = [c for c, on in (("tokens", args.tokens_npy), ("logits", args.logits_npy),
                              ("ppl", args.engine_json)) if on]
    if checks:
        log(f"{'PASS' if ok else 'FAIL'}: {', '.join(checks)} vs float64 reference "
            f"(n {n}, PPL {ppl:.4f})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
