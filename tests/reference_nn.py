"""The layers' previous (pre-issue-20) forward/backward, kept verbatim as the reference the lean
versions are compared against (tests/test_nn_lean.py): ``as_reference(model)`` makes every
sub-module of ``model`` run its previous code on its own parameters."""

from __future__ import annotations

from typing import Any

import numpy as np

from hpctrain import nn
from hpctrain.backend import to_device, xp_of

_GELU_C = float(np.sqrt(2.0 / np.pi))


def linear_forward(self, x):
    self.cache = x
    y = x @ self.weight.data
    if self.bias is not None:
        y += self.bias.data
    return y


def linear_backward(self, grad_out):
    x = self.cache
    x2 = x.reshape(-1, self.d_in)
    g2 = grad_out.reshape(-1, self.d_out)
    self.weight.grad += x2.T @ g2
    if self.bias is not None:
        self.bias.grad += g2.sum(axis=0)
    return grad_out @ self.weight.data.T


def gelu_forward(self, x):
    t = np.tanh(_GELU_C * (x + 0.044715 * (x * x * x)))
    self.cache = (x, t)
    return 0.5 * x * (1.0 + t)


def gelu_backward(self, grad_out):
    x, t = self.cache
    dt = (1.0 - t * t) * (_GELU_C * (1.0 + 0.134145 * (x * x)))
    return grad_out * (0.5 * (1.0 + t) + 0.5 * x * dt)


def layernorm_forward(self, x):
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + self.eps)
    xhat = xc * rstd
    self.cache = (xhat, rstd)
    return xhat * self.weight.data + self.bias.data


def layernorm_backward(self, grad_out):
    xhat, rstd = self.cache
    g2 = grad_out.reshape(-1, self.d)
    self.weight.grad += (g2 * xhat.reshape(-1, self.d)).sum(axis=0)
    self.bias.grad += g2.sum(axis=0)
    gx = grad_out * self.weight.data
    return rstd * (gx - gx.mean(axis=-1, keepdims=True) - xhat * (gx * xhat).mean(axis=-1, keepdims=True))


def embedding_forward(self, idx):
    idx = to_device(idx, np)
    self.cache = idx
    return self.weight.data[idx]


def embedding_backward(self, grad_out):
    np.add.at(self.weight.grad, self.cache.reshape(-1), grad_out.reshape(-1, self.d))


def causal_attention(q, k, v):
    t, hd = q.shape[-2], q.shape[-1]
    scores = (q @ np.swapaxes(k, -1, -2)) * (1.0 / float(np.sqrt(hd)))
    future = np.triu(np.ones((t, t), dtype=bool), k=1)
    scores = np.where(future, np.asarray(-np.inf, dtype=scores.dtype), scores)
    scores = scores - scores.max(axis=-1, keepdims=True)
    att = np.exp(scores)
    att /= att.sum(axis=-1, keepdims=True)
    return att @ v, att


def causal_attention_backward(dy, q, k, v, att):
    scale = 1.0 / float(np.sqrt(q.shape[-1]))
    dv = np.swapaxes(att, -1, -2) @ dy
    datt = dy @ np.swapaxes(v, -1, -2)
    dscores = att * (datt - (datt * att).sum(axis=-1, keepdims=True))
    dscores *= scale
    return dscores @ k, np.swapaxes(dscores, -1, -2) @ q, dv


def attention_forward(self, x):
    b, t, d = x.shape
    h = self.n_heads
    qkv = self.qkv.forward(x).reshape(b, t, 3, h, d // h).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    y, att = causal_attention(q, k, v)
    self.cache = (q, k, v, att)
    return self.proj.forward(y.transpose(0, 2, 1, 3).reshape(b, t, d))


def attention_backward(self, grad_out):
    q, k, v, att = self.cache
    b, h, t, hd = q.shape
    dy = self.proj.backward(grad_out).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
    dq, dk, dv = causal_attention_backward(dy, q, k, v, att)
    dqkv = np.stack([dq, dk, dv]).transpose(1, 3, 0, 2, 4).reshape(b, t, 3 * h * hd)
    return self.qkv.backward(dqkv)


def block_forward(self, x):
    x = x + self.attn.forward(self.ln1.forward(x))
    return x + self.mlp.forward(self.ln2.forward(x))


def block_backward(self, grad_out):
    g = grad_out + self.ln2.backward(self.mlp.backward(grad_out))
    return g + self.ln1.backward(self.attn.backward(g))


def gpt_forward(self, idx):
    x = self.tok_emb.forward(idx) + self.pos_emb.forward(np.arange(idx.shape[1]))
    return self.head.forward(self.ln_f.forward(self.blocks.forward(x)))


def gpt_backward(self, grad_out):
    g = self.blocks.backward(self.ln_f.backward(self.head.backward(grad_out)))
    self.tok_emb.backward(g)
    self.pos_emb.backward(g.sum(axis=0))


METHODS = {
    nn.Linear: (linear_forward, linear_backward),
    nn.GELU: (gelu_forward, gelu_backward),
    nn.LayerNorm: (layernorm_forward, layernorm_backward),
    nn.Embedding: (embedding_forward, embedding_backward),
    nn.CausalSelfAttention: (attention_forward, attention_backward),
    nn.TransformerBlock: (block_forward, block_backward),
    nn.GPT: (gpt_forward, gpt_backward),
}


def as_reference(model: Any) -> Any:
    """Make ``model`` and its sub-modules run the previous forward/backward (instance attributes)."""
    for _, m in model.named_modules():
        methods = METHODS.get(type(m))
        if methods is not None:
            m.forward, m.backward = (f.__get__(m) for f in methods)
    return model


class ReferenceCrossEntropy:
    """The previous CrossEntropyLoss."""

    def forward(self, logits, target, weight=None):
        from hpctrain.nn.losses import per_sample_weight

        shifted = logits - logits.max(axis=-1, keepdims=True)
        exp = np.exp(shifted)
        sumexp = exp.sum(axis=-1, keepdims=True)
        logp_t = np.take_along_axis(shifted, target[..., None], axis=-1)[..., 0] - np.log(sumexp[..., 0])
        nll = -logp_t
        w, denom = per_sample_weight(weight, nll)
        if w is not None:
            nll = nll * w
        self.cache = (exp / sumexp, target, w, denom)
        return float(nll.sum()) / denom if denom else 0.0

    def backward(self, scale=1.0):
        probs, target, w, denom = self.cache
        g = probs.copy()
        if not denom:
            return g * 0
        onehot_at = np.take_along_axis(g, target[..., None], axis=-1) - 1
        np.put_along_axis(g, target[..., None], onehot_at, axis=-1)
        g *= scale / denom
        return g * w[..., None] if w is not None else g


def reference_adam_update(opt, p, state, lr):
    """The previous Adam/AdamW ``_update``."""
    b1, b2 = opt.betas
    t = opt.step_count
    g = p.grad
    if opt.weight_decay:
        if opt.decoupled:
            p.data *= 1 - lr * opt.weight_decay
        else:
            g = g + opt.weight_decay * p.data
    if "exp_avg" not in state:
        state["exp_avg"] = np.zeros_like(p.data)
        state["exp_avg_sq"] = np.zeros_like(p.data)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m *= b1
    m += (1 - b1) * g
    v *= b2
    v += (1 - b2) * (g * g)
    step_size = lr / (1 - b1**t)
    denom = np.sqrt(v / (1 - b2**t)) + opt.eps
    p.data -= step_size * (m / denom)


__all__ = ["METHODS", "ReferenceCrossEntropy", "as_reference", "reference_adam_update", "xp_of"]
