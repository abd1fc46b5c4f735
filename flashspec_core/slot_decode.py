"""Answers to many prompts from a fixed set of rows ("slots"), each row refilled with the next prompt as soon as its
answer ends: the decode step keeps one shape, [rows, 1], for the whole run (one CUDA graph), and no row idles while
the batch's longest answer finishes (a static batch of the draft head's data was half idle that way).

The KV cache is a ring of W columns shared by the rows: step t writes column t % W of every row. A row attends to the
columns written since its prompt went in (`seen`, [rows, W]); its keys carry RoPE at the row's own positions, so
where a column sits in the ring never matters (attention is a sum over keys). A prompt of L tokens goes into the L
columns before the next one to be written, computed by a forward over the new prompts alone, and its answer takes
at most max_new columns more: L + max_new <= W, so a live row never overwrites its own keys.

Llama-family models (the embedded target): the decoder layers' own modules (projections, norms, MLP, rotary
embedding) with an attention over the ring. Greedy rows (temperature 0) give the target's greedy answers; a sampled
row draws each token from softmax(logits / T) by the Gumbel-max trick (`head_data.RowTemperature`).
"""
from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

CHECK_EVERY = 8  # decode steps between the host's looks at which rows finished (one device sync each)


class SlotDecoder:
    """The ring cache and each row's state for one model; `answer` runs a list of prompts through it."""

    def __init__(self, model, rows: int, width: int, eos: set[int], max_new: int, graphs: bool | None = None):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        from flashspec_core.fast_path import head_size

        self.model, self.rows, self.W, self.max_new = model, rows, width, max_new
        self.rope = apply_rotary_pos_emb
        inner = model.model
        cfg = model.config
        self.D = head_size(cfg)
        self.Hkv, self.G = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
        dev, dt = model.device, inner.embed_tokens.weight.dtype
        shape = (len(inner.layers), rows, self.Hkv, width, self.D)
        self.keys, self.values = torch.zeros(shape, device=dev, dtype=dt), torch.zeros(shape, device=dev, dtype=dt)
        self.eos = torch.tensor(sorted(eos), device=dev)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=dev)  # each row's next input token
        self.pos = torch.zeros(rows, dtype=torch.int64, device=dev)  # ... and its position
        self.col = torch.zeros((), dtype=torch.int64, device=dev)  # the ring column the next step writes
        self.seen = torch.zeros(rows, width, dtype=torch.bool, device=dev)
        self.temps = torch.zeros(rows, device=dev)
        self.out = torch.zeros(rows, max_new, dtype=torch.int64, device=dev)  # each row's answer so far
        self.n = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)
        self.graphs = dev.type == "cuda" if graphs is None else graphs
        self.graph = None
        self.steps = 0  # decode steps run

    # -- the decode step ------------------------------------------------------------------------------------------
    def _step(self) -> None:
        """One token for every row, in place: its keys at column `col`, the next token drawn, the answer extended."""
        inner = self.model.model
        B = self.rows
        self.seen.index_fill_(1, self.col.view(1), True)
        x = inner.embed_tokens(self.tokens)[:, None]
        cos, sin = inner.rotary_emb(x, self.pos[:, None])
        mask = self.seen[:, None, None, :]
        for i, layer in enumerate(inner.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            self.keys[i].index_copy_(2, self.col.view(1), k)
            self.values[i].index_copy_(2, self.col.view(1), v)
            a = F.scaled_dot_product_attention(q.reshape(B, self.Hkv, self.G, self.D), self.keys[i], self.values[i],
                                               attn_mask=mask)  # a group's query heads share one key/value head
            x = x + layer.self_attn.o_proj(a.reshape(B, 1, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        token = self._pick(self.model.lm_head(inner.norm(x[:, -1])), self.temps)
        live = ~self.done
        at = self.n.clamp(max=self.max_new - 1)[:, None]
        self.out.scatter_(1, at, torch.where(live, token, self.out.gather(1, at)[:, 0])[:, None])
        self.n += live
        self.done |= (token[:, None] == self.eos).any(-1) | (self.n >= self.max_new)
        self.tokens.copy_(token)
        self.pos += 1
        self.col.copy_((self.col + 1) % self.W)

    def _qkv(self, layer, h: torch.Tensor, cos, sin):
        """Queries [B, H, T, D] and keys, values [B, H_kv, T, D] of hidden states h [B, T, hidden], RoPE applied."""
        B, T, _ = h.shape
        attn = layer.self_attn
        q = attn.q_proj(h).view(B, T, -1, self.D).transpose(1, 2)
        k = attn.k_proj(h).view(B, T, -1, self.D).transpose(1, 2)
        v = attn.v_proj(h).view(B, T, -1, self.D).transpose(1, 2)
        q, k = self.rope(q, k, cos, sin)
        return q, k, v

    @staticmethod
    def _pick(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
        """Each row's token: its argmax at temperature 0, else a draw at its temperature (Gumbel-max)."""
        from flashspec_core.head_data import RowTemperature

        return RowTemperature(temps)(None, logits).argmax(dim=-1)

    def step(self) -> None:
        """`_step`, replayed from a CUDA graph on a GPU (captured at the first call)."""
        self.steps += 1
        if not self.graphs:
            return self._step()
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._step()  # warm-up outside the capture
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._step()
        self.graph.replay()

    # -- prompts in -----------------------------------------------------------------------------------------------
    def fill(self, rows: list[int], prompts: list[list[int]], temps: list[float]) -> None:
        """Rows `rows` start on `prompts` (each at most W - max_new tokens): a forward over the prompts alone writes
        their keys into the columns before `col`, and draws each answer's first token."""
        dev, T = self.tokens.device, max(map(len, prompts))
        if T + self.max_new > self.W:
            raise ValueError(f"a prompt of {T} tokens and {self.max_new} new ones do not fit {self.W} columns")
        pad = torch.tensor([T - len(p) for p in prompts], device=dev)
        ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts], device=dev)
        j = torch.arange(T, device=dev)
        pos = (j[None, :] - pad[:, None]).clamp(min=0)
        idx = torch.tensor(rows, device=dev)
        cols = (self.col - T + j) % self.W
        causal = (j[None, :] <= j[:, None]) & ((j[None, None, :] >= pad[:, None, None]) | (j[None, :] == j[:, None]))
        logits = self._prefill(ids, pos, causal[:, None], idx, cols)
        self.temps[idx] = torch.tensor(temps, device=dev, dtype=self.temps.dtype)
        self.seen[idx] = False
        self.seen[idx[:, None], cols[None, :]] = j[None, :] >= pad[:, None]
        first = self._pick(logits, self.temps[idx])
        self.out[idx] = 0
        self.out[idx, 0] = first
        self.n[idx] = 1
        self.done[idx] = (first[:, None] == self.eos).any(-1) | (self.max_new <= 1)
        self.tokens[idx], self.pos[idx] = first, pos[:, -1] + 1

    def _prefill(self, ids, pos, mask, idx, cols) -> torch.Tensor:
        """The prompts' forward [n, T]: their keys and values written to rows idx at columns cols; last logits."""
        inner = self.model.model
        x = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(x, pos)
        for i, layer in enumerate(inner.layers):
            q, k, v = self._qkv(layer, layer.input_layernorm(x), cos, sin)
            self.keys[i][idx[:, None], :, cols[None, :]] = k.transpose(1, 2)
            self.values[i][idx[:, None], :, cols[None, :]] = v.transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            x = x + layer.self_attn.o_proj(a.transpose(1, 2).reshape(*x.shape[:2], -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.model.lm_head(inner.norm(x[:, -1]))

    # -- a whole list of prompts ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def answer(self, prompts: list[list[int]], temps: list[float]) -> list[list[int]]:
        """Each prompt's answer (cut after its first end-of-turn token, at most max_new tokens)."""
        out: list[list[int]] = [[] for _ in prompts]
        queue = deque(range(len(prompts)))
        job: list[int | None] = [None] * self.rows
        free = list(range(self.rows))
        while queue or any(j is not None for j in job):
            if queue and free:
                take = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                rows, free = free[:len(take)], free[len(take):]
                self.fill(rows, [prompts[i] for i in take], [temps[i] for i in take])
                for r, i in zip(rows, take):
                    job[r] = i
            for _ in range(CHECK_EVERY):
                self.step()
            finished = [r for r in self.done.nonzero()[:, 0].tolist() if job[r] is not None]
            if finished:
                got, lengths = self.out[finished].tolist(), self.n[finished].tolist()
                for r, ids, n in zip(finished, got, lengths):
                    out[job[r]], job[r] = ids[:n], None
                free += finished
        return out
