"""Lessons 09-11's text and their small GPT: real text that needs no download, and the model lesson 09 writes out.

The text is Python's own standard library: every ``.py`` file under ``sysconfig``'s ``stdlib`` folder (tests,
``site-packages`` and the IDLE editor left out), read in sorted order, as bytes. Tokens are the bytes (0–255) and
one end-of-file token, ``EOT`` = 256, between files: a vocabulary of 257, as awkward a number as GPT-2's 50257, so
that padding it to a multiple of 64 is a real choice. The same Python version gives the same text on every machine.

``GPT`` is nanoGPT's shape (token and position embeddings, pre-LayerNorm blocks of causal self-attention and an
MLP, a head tied to the token embedding) exactly as lesson 09 writes it out in its notebook; it lives here too so
that lessons 10 and 11, the exercise checks and the tests can build a model of any configuration.
"""

import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

EOT = 256  # the end-of-file token
VOCAB = 257  # 256 bytes and EOT
_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__", "turtledemo"}


def source_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files (or those under ``root``), sorted, tests and third-party packages left
    out."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in _SKIP and not d.startswith("."))
        found += [Path(folder) / name for name in files if name.endswith(".py")]
    return sorted(found)


def python_source(max_bytes: int | None = None, root: str | Path | None = None) -> torch.Tensor:
    """Python's standard library as tokens: an int64 tensor of bytes (0–255) with ``EOT`` after each file, at most
    ``max_bytes`` tokens (files are read in sorted order until there are enough)."""
    parts, total = [], 0
    for path in source_files(root):
        data = path.read_bytes() + b"\0"  # a placeholder byte for EOT, replaced below
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        tokens[-1] = EOT
        parts.append(tokens)
        total += len(tokens)
        if max_bytes is not None and total >= max_bytes:
            break
    if not parts:
        raise FileNotFoundError(f"no .py files under {root or sysconfig.get_paths()['stdlib']}")
    tokens = torch.cat(parts)
    return tokens[:max_bytes] if max_bytes is not None else tokens


def split(tokens: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last ``val_fraction`` of the text is held out."""
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def batch(tokens: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator | None = None,
          device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``seq_len`` tokens (inputs) and the same windows shifted by one (targets)."""
    starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
    windows = torch.stack([tokens[s:s + seq_len + 1] for s in starts.tolist()])
    if device is not None:
        windows = windows.to(device, non_blocking=True)
    return windows[:, :-1], windows[:, 1:]


def decode(tokens) -> str:
    """Tokens back to text (EOT shown as a line ``<EOT>``; bytes that are not UTF-8 replaced)."""
    out, run = [], bytearray()
    for t in (int(t) for t in tokens):
        if t == EOT:
            out.append(run.decode("utf-8", "replace") + "\n<EOT>\n")
            run = bytearray()
        elif 0 <= t < 256:
            run.append(t)
        else:
            run += b"?"
    return "".join(out) + run.decode("utf-8", "replace")


# ----- the lesson's GPT, as the notebook writes it out ----------------------------------------------------------

@dataclass
class GPTConfig:
    vocab_size: int = VOCAB
    seq_len: int = 1024
    n_layer: int = 8
    n_head: int = 12
    n_embd: int = 768
    attention: str = "manual"  # "manual": written out; "sdpa": F.scaled_dot_product_attention
    checkpoint: bool = False  # recompute each block's activations in the backward pass (lesson 11)
    padded_vocab: int = 0  # more than vocab_size: the embedding and the head get this many rows (lesson 10)


def manual_attention(q, k, v):
    """Causal self-attention written out; q, k, v are (batch, heads, T, head_dim)."""
    T = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))  # (batch, heads, T, T): quadratic in T
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return F.softmax(scores, dim=-1) @ v


def sdpa_attention(q, k, v):
    """The same with PyTorch's fused kernels (flash, memory-efficient, cuDNN or math, whichever applies)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


ATTENTION = {"manual": manual_attention, "sdpa": sdpa_attention}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.attend = cfg.n_head, ATTENTION[cfg.attention]
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc2 = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.n_embd), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.n_embd), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        rows = max(cfg.vocab_size, cfg.padded_vocab)
        with torch.random.fork_rng(devices=[]):
            self.wte = nn.Embedding(rows, cfg.n_embd)
            self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd)
            self.head = nn.Linear(cfg.n_embd, rows, bias=False)
            self.head.weight = self.wte.weight  # tied: one matrix embeds tokens and scores them
            torch.manual_seed(seed)  # GPT-2's initialisation; the embedding last, so padding changes no other weight
            for name, p in sorted(self.named_parameters(), key=lambda item: item[0] == "wte.weight"):
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "fc2.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

    def forward(self, idx, targets=None):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.cfg.checkpoint and self.training else block(x)
        logits = self.head(self.ln_f(x))[..., :self.cfg.vocab_size]  # padded rows score nothing
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def parameters(model: nn.Module, *, position: bool = True) -> int:
    """The model's parameters, each shared tensor once; ``position=False`` leaves the position embedding out (the N
    of the 6·N rule, as nanoGPT counts it)."""
    n = sum(p.numel() for p in model.parameters())
    return n if position else n - model.wpe.weight.numel()
