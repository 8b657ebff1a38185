"""
A Qwen3-style decoder with five residual modes: the standard residual stream, Kimi's Attention
Residuals (Full and Block AttnRes, arXiv 2603.15031) and Delta Attention Residuals (Delta AttnRes and
Delta Block, arXiv 2605.18855). One file, read top to bottom:

1. the routing rule (`route`), the papers' core, in a few lines, and `Routing`, the state a forward pass
   routes with: its sources and its verbs (start, route a site, a sublayer done); `OfficialRouting`, the
   bookkeeping of the authors' code (variant='official'), in a few lines of its own; `routing_schedule`, the
   routing sites in forward order (GPT.sites), which everything that depends on the sites reads;
2. the Qwen3 building blocks (RoPE, grouped-query attention with q/k norms, SwiGLU MLP);
3. `GPT.forward`, where the five modes are two switches on one loop:
      which sources are routed   (every sublayer's output, or per-block sums), and
      how the routed mix is used (it REPLACES the sublayer input, or is ADDED to the residual stream);
   the loop is the same for every mode and variant: routing.route before a sublayer, routing.done after it;
4. the optimizer and MFU helpers.
The speed machinery is in fast_routing.py, which Routing calls: the same numbers as route() with activation memory
linear in depth and each source read once per group of sites. A reader may skip it; `GPT.fast_routing = False`
routes with route() alone. model.py and fast_routing.py import nothing else of this repo (exported directories
carry both); Hugging Face checkpoints in and out: checkpoints.py.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

try:    # inside an exported Hugging Face directory, which transformers imports as a package
    from .fast_routing import EAGER, FastRouting, RoutingOps, two_phase_schedule
except ImportError:
    from fast_routing import EAGER, FastRouting, RoutingOps, two_phase_schedule

# residual mode -> (source granularity, how the routed mix enters the sublayer input)
RESIDUAL_MODES = {
    'standard':      (None,       None),       # h <- h + f(h)
    'full_attnres':  ('sublayer', 'replace'),  # Kimi Full AttnRes:  x = sum_i a_i v_i
    'attnres':       ('block',    'replace'),  # Kimi Block AttnRes: x = sum_i a_i b_i
    'delta_attnres': ('sublayer', 'add'),      # Delta AttnRes:      x = h + sum_i a_i v_i
    'delta_block':   ('block',    'add'),      # Delta Block:        x = h + sum_i a_i Delta_i
}


@dataclass
class GPTConfig:
    vocab_size: int = 50304
    block_size: int = 1024          # longest sequence the model accepts (RoPE tables are this long)
    n_layer: int = 12
    n_head: int = 12                # query heads
    n_kv_head: int = 4              # key/value heads (grouped-query attention)
    n_embd: int = 768
    head_dim: int = 64
    intermediate_size: int = 3072
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = True
    residual: str = 'standard'      # one of RESIDUAL_MODES
    n_blocks: int = 4               # blocks for 'attnres' / 'delta_block'
    res_gate: bool = False          # additive modes: x = h + gate * routed, one learnable scalar per site
    variant: str = 'paper'          # 'paper': the papers' definitions; 'official': the authors' code as run (Delta modes)

    def __post_init__(self):
        if self.residual not in RESIDUAL_MODES:
            raise ValueError(f"unknown residual mode {self.residual!r}; expected one of {', '.join(RESIDUAL_MODES)}")
        for name in ('vocab_size', 'block_size', 'n_layer', 'n_head', 'n_kv_head', 'n_embd', 'head_dim', 'intermediate_size'):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not 1 <= self.n_blocks <= self.n_layer:
            raise ValueError(f"n_blocks must be in 1..n_layer={self.n_layer}, got {self.n_blocks}")
        if self.variant not in ('paper', 'official'):
            raise ValueError(f"variant must be 'paper' or 'official', got {self.variant!r}")
        if self.res_gate and RESIDUAL_MODES[self.residual][1] != 'add':
            raise ValueError(f"res_gate applies to the additive modes (delta_attnres, delta_block), not {self.residual!r}")
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}) for grouped-query attention")
        for name in ('rope_theta', 'rms_norm_eps'):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a positive, finite number, got {value!r}")
        for name in ('tie_embeddings', 'res_gate'):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def layers_per_block(self):
        # block k is layers [k*lpb, (k+1)*lpb); the last block may be shorter
        return math.ceil(self.n_layer / self.n_blocks)

    @property
    def official(self):
        # variant='official' changes the bookkeeping of the additive modes only (see GPT.forward);
        # for standard, attnres and full_attnres the authors' code computes the papers' definitions
        return self.variant == 'official' and RESIDUAL_MODES[self.residual][1] == 'add'

    def routed(self, i, kind):
        """Does sublayer (layer i, 'attn' or 'mlp') route its input? Every one does, except in 'standard' and the
        official variant's first attention (the authors' code routes it over nothing)."""
        return self.residual != 'standard' and not (self.official and i == 0 and kind == 'attn')


# -----------------------------------------------------------------------------
# The routing rule. One routing site = a pseudo-query w (a bias-free Linear(d, 1), zero-init) and an
# RMSNorm with its own weight g. Over sources s_1..s_N, separately for every token:
#
#     alpha_i = softmax_i( w . RMSNorm_g(s_i) )          (fp32 softmax, no 1/sqrt(d))
#     route   = sum_i alpha_i s_i
#
# The norm only shapes the logits ("keys"); the values are the raw sources. With w = 0 every alpha_i
# is exactly 1/N.

def route(sources, proj, norm):
    """sources: list of N tensors (B, T, d). Returns (sum_i alpha_i s_i, alpha of shape (N, B, T))."""
    V = torch.stack(sources)                                   # (N, B, T, d)
    logits = proj(norm(V)).squeeze(-1)                         # (N, B, T) = w . RMSNorm(s_i)
    alpha = logits.float().softmax(dim=0)
    return torch.einsum('nbt,nbtd->btd', alpha.to(V.dtype), V), alpha


def routing_stats(alpha):
    """The papers' diagnostics for one site: how peaked the weights are, and where they go."""
    return {
        'max_weight': alpha.max(dim=0).values.mean(),                        # mean over tokens of max_i alpha_i
        'entropy': -(alpha * alpha.clamp_min(1e-30).log()).sum(0).mean(),   # mean over tokens, in nats
        'weights': alpha.mean(dim=(1, 2)),                                   # mean weight of each source
    }


class Routing:
    """The routing state of one forward pass, passed explicitly through GPT.forward's loop:
        sources    the completed sources, in order ([E, v_0, v_1, ...] or [E, b_1, b_2, ...])
        block      the block modes' open block: the running sum of its sublayer outputs, or None
        last       the last sublayer's output (i, kind, v), which joins them when the next site routes
    and the three verbs the loop calls in every mode:
        start(E)                          the embedding is the first source
        route(site, proj, norm, h, gate)  this site's sublayer input (site: a Site of GPT.sites)
        done(i, kind, v, h)               sublayer (i, kind) read h and returned v: v is a source for every later
                                          site (sublayer modes), or joins the open block, which is a source once
                                          the block is complete (block modes)
    fast: a fast_routing.FastRouting for these sites, which computes the same numbers with less memory and traffic,
    or None: route() itself at every site. stats: a dict to fill with each site's routing_stats, or None."""

    def __init__(self, config, fast=None, stats=None):
        self.granularity, self.n_layer, self.lpb = RESIDUAL_MODES[config.residual][0], config.n_layer, config.layers_per_block
        self.sources, self.block, self.last = [], None, None
        self.fast, self.stats = fast, stats

    def complete(self, s):
        self.sources.append(s)
        if self.fast is not None:
            self.fast.add(s)

    def start(self, E):
        self.complete(E)

    def done(self, i, kind, v, h):
        self.last = (i, kind, v)

    def _take_last(self):
        """The last sublayer's output joins the sources (or the open block) before the next site routes: after the
        loop's h <- h + v, the order of operations the model has always had (its gradients stay the same bits)."""
        if self.last is None:
            return
        (i, kind, v), self.last = self.last, None
        if self.granularity == 'sublayer':
            self.complete(v)
        else:
            self.block = v if self.block is None else self.block + v        # = h(now) - h(block start) in Delta Block
            if kind == 'mlp' and (i + 1) % self.lpb == 0 and i + 1 < self.n_layer:
                self.complete(self.block)                                   # the block is complete
                self.block = None

    def mixes(self):
        """What the next site mixes: the completed sources, and the open block (None: no open block)."""
        self._take_last()
        return self.sources, self.block

    def route(self, site, proj, norm, h=None, gate=None):
        """The site's sublayer input: the routed mix (replace: h=None), or h + gate * mix (add; gate None: 1)."""
        sources, block = self.mixes()
        if self.fast is not None:
            x, alpha = self.fast.route(site.index, sources, block, h, gate)
        else:
            out, alpha = route(sources + ([] if block is None else [block]), proj, norm)
            x = out if h is None else h + (out if gate is None else gate * out)
        if self.stats is not None:
            with torch.no_grad():
                self.stats[site.name] = routing_stats(self.fast.weights(site.index) if alpha is None else alpha)
        return x


class OfficialRouting(Routing):
    """variant='official': the bookkeeping of the authors' code for the two Delta modes, which produced the paper's
    numbers (docs/fidelity.md). E is not a source from the start; a block becomes a source only after the next
    block's first attention has routed without it, and as h - (the previous source) rather than the block's delta,
    the first such source being E itself; Delta Block's open block is no source. Delta AttnRes is one block of all
    layers here: E becomes a source after the first attention, which is not routed."""

    def start(self, E):
        pass

    def done(self, i, kind, v, h):
        if kind == 'attn' and i % (self.lpb if self.granularity == 'block' else self.n_layer) == 0:
            self.complete(h - self.sources[-1] if self.sources else h)     # h: the stream this attention read
        if self.granularity == 'sublayer':
            self.last = (i, kind, v)


class Site(NamedTuple):
    """One routing site of the schedule (GPT.sites): its place in forward order, its name ('layers.3.attn', 'final'),
    its sublayer (layer None: the final site), and what it mixes: n completed sources, and the open block if open=1."""
    index: int
    name: str
    layer: Optional[int]
    kind: str
    n: int
    open: int


def routing_schedule(config):
    """The routing sites in forward order: the one schedule that the forward pass, the parameter order, the FLOP
    count, the two-phase groups and bench.py's traffic model read. What each site mixes is not a second formula:
    it is Routing's own bookkeeping, run here on placeholders (0 for every tensor: it only adds and subtracts them)."""
    replace = RESIDUAL_MODES[config.residual][1] == 'replace'
    routing = (OfficialRouting if config.official else Routing)(config)
    sites = []

    def site(name, layer, kind):
        sources, block = routing.mixes()
        sites.append(Site(len(sites), name, layer, kind, len(sources), int(block is not None)))

    routing.start(0)
    for i in range(config.n_layer):
        for kind in ('attn', 'mlp'):
            if config.routed(i, kind):
                site(f'layers.{i}.{kind}', i, kind)
            routing.done(i, kind, 0, 0)
    if replace:
        site('final', None, 'final')
    return sites


def site_parameters(module, kind):
    """(pseudo-query, key norm, gate) of the routing site `kind` that module owns; None for each it does not have."""
    return tuple(getattr(module, f'{kind}_res_{part}', None) for part in ('proj', 'norm', 'gate'))


# -----------------------------------------------------------------------------
# Qwen3 building blocks

def rope_tables(head_dim, length, theta):
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)                  # rotate-half layout: [f_0..f_{k-1}, f_0..f_{k-1}]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)                        # rotate_half(x)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query causal self-attention with Qwen3's per-head RMSNorm on q and k (before RoPE)."""

    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.q_proj = nn.Linear(cfg.n_embd, cfg.n_head * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.n_embd, cfg.n_kv_head * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * cfg.head_dim, cfg.n_embd, bias=False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.rms_norm_eps)

    def forward(self, x, cos, sin, kv=None):
        """kv: this layer's entry of a KVCache (a dict), or None. With a cache, x holds only the new
        tokens; their keys/values are appended to the cached ones and every new token attends to all
        cached tokens and to the new tokens up to itself."""
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.n_kv_head, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)   # cos/sin are already at the right positions
        past = 0
        if kv is not None:
            if 'k' in kv:
                past = kv['k'].size(2)
                k, v = torch.cat((kv['k'], k), dim=2), torch.cat((kv['v'], v), dim=2)
            kv['k'], kv['v'] = k, v
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:   # is_causal aligns the mask top-left; new token t (absolute past+t) sees keys 0..past+t
            mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class KVCache:
    """Keys and values of every attention layer for the tokens seen so far, and how many tokens that
    is (`pos`, the RoPE offset of the next token). Routing mixes over depth, separately for every token,
    so it needs no cache: a new token's sources are built from the new token alone.
        cache = KVCache(model.config.n_layer)
        logits, _ = model(prompt, kv_cache=cache)        # prefill
        logits, _ = model(next_token, kv_cache=cache)    # one token at a time
    """

    def __init__(self, n_layer):
        self.layers = [{} for _ in range(n_layer)]
        self.pos = 0


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.n_embd, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    """One decoder layer = two sublayers, f_attn(x) = attn(norm(x)) and f_mlp(x) = mlp(norm(x)),
    each with its own routing site (pseudo-query + key norm) unless the mode is 'standard' (or the
    site is the official variant's unrouted first attention). The residual bookkeeping lives in
    GPT.forward, so that one loop serves every mode."""

    def __init__(self, cfg, index):
        super().__init__()
        d = cfg.n_embd
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(d, eps=cfg.rms_norm_eps)
        for kind in [k for k in ('attn', 'mlp') if cfg.routed(index, k)]:
            self.add_module(f'{kind}_res_proj', nn.Linear(d, 1, bias=False))
            self.add_module(f'{kind}_res_norm', nn.RMSNorm(d, eps=cfg.rms_norm_eps))
            if cfg.res_gate:
                # 1 = the plain additive mode; checkpoints.load_hf(..., identity_init=True) sets 0.
                # Shape (1,), not a 0-dim scalar: FSDP2 shards every parameter along dim 0 and refuses scalars.
                self.register_parameter(f'{kind}_res_gate', nn.Parameter(torch.ones(1)))

    def sublayers(self, cos, sin, kv=None):
        """(name, f, query, key norm, gate) for the attention and the MLP sublayer, in order; the routing
        parts are None where the mode has none (the gate exists only with res_gate=True)."""
        return (
            ('attn', lambda x: self.self_attn(self.input_layernorm(x), cos, sin, kv), *site_parameters(self, 'attn')),
            ('mlp', lambda x: self.mlp(self.post_attention_layernorm(x)), *site_parameters(self, 'mlp')),
        )


# -----------------------------------------------------------------------------

class GPT(nn.Module):
    fast_routing = True     # False: the plain route() at every site (the specification; bench.py's naive baseline)
    routing_ops = EAGER     # the routing math; compile_regional compiles it (RoutingOps)

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.granularity, self.mixing = RESIDUAL_MODES[config.residual]
        self.embed_tokens = nn.Embedding(config.vocab_size, config.n_embd)
        self.layers = nn.ModuleList(Layer(config, i) for i in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if self.mixing == 'replace':
            # AttnRes replaces the residual stream, so the final norm also reads a routed mix
            self.final_res_proj = nn.Linear(config.n_embd, 1, bias=False)
            self.final_res_norm = nn.RMSNorm(config.n_embd, eps=config.rms_norm_eps)
        self.sites = {s.name: s for s in routing_schedule(config)}      # the routing sites, in forward order
        # two-phase routing (the sublayer modes): its groups of sites, [(first site, number of sites)]
        self.routing_groups = two_phase_schedule(self.sites.values()) if self.granularity == 'sublayer' else None
        cos, sin = rope_tables(config.head_dim, config.block_size, config.rope_theta)
        self.register_buffer('rope_cos', cos, persistent=False)
        self.register_buffer('rope_sin', sin, persistent=False)
        self.apply(self._init_weights)
        self.init_queries(0.0)

    def _init_weights(self, module):
        # Qwen3 from scratch: N(0, 0.02) for Linear and Embedding, norm weights 1 (nn.RMSNorm's default)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @torch.no_grad()
    def init_queries(self, std):
        """Every pseudo-query w drawn from N(0, std^2). std=0, the papers' init: zero queries, so every site starts as a
        uniform average of its sources. The authors' code leaves them at Hugging Face's normal init, std 0.02; in a
        replacement mode that is no longer a rescaled h (results/README.md: the converted AttnRes's loss jump)."""
        for name, p in self.named_parameters():
            if name.endswith('_res_proj.weight'):
                p.normal_(0.0, std) if std > 0 else p.zero_()

    def get_num_params(self, non_embedding=False):
        """Parameter count, tied weights once; non_embedding=True leaves out the embedding table."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed_tokens.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None, stats=False, kv_cache=None):
        """idx (B, T) token ids -> (logits (B, T, V), mean cross-entropy or None).
        With stats=True also returns {site: routing_stats} (computed without gradients).
        With a KVCache, idx holds only the tokens after the cached ones (incremental decoding)."""
        B, T = idx.shape
        pos = 0 if kv_cache is None else kv_cache.pos
        if pos + T > self.config.block_size:
            raise ValueError(f"sequence length {pos + T}{f' ({pos} cached + {T} new)' if pos else ''} "
                             f"exceeds block_size {self.config.block_size}")
        # Checked where it is free: on a GPU, reading the range would wait for the device at every forward (an
        # out-of-range id fails there anyway, in the embedding's device-side assert, less readably).
        if idx.device.type == 'cpu' and not torch.compiler.is_compiling():
            lo, hi = torch.aminmax(idx)
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.config.vocab_size}), got range [{lo}, {hi}]")
        cos, sin = self.rope_cos[pos:pos + T], self.rope_sin[pos:pos + T]
        replace, site_stats = self.mixing == 'replace', {}
        E = self.embed_tokens(idx)
        h = E                   # the ordinary residual stream (standard and Delta modes)
        fast = (FastRouting(self.routing_parameters(), self.config.rms_norm_eps, self.routing_groups, self.routing_ops)
                if self.fast_routing else None)
        routing = (OfficialRouting if self.config.official else Routing)(self.config, fast, site_stats if stats else None)
        routing.start(E)
        for i, layer in enumerate(self.layers):
            for kind, f, proj, norm, gate in layer.sublayers(cos, sin, None if kv_cache is None else kv_cache.layers[i]):
                site = self.sites.get(f'layers.{i}.{kind}')
                x = h if site is None else routing.route(site, proj, norm, None if replace else h, gate)
                v = f(x)
                routing.done(i, kind, v, h)
                if not replace:
                    h = h + v                                          # the residual stream is kept
        if replace:
            h = routing.route(self.sites['final'], self.final_res_proj, self.final_res_norm)

        if kv_cache is not None:
            kv_cache.pos += T
        logits = self.lm_head(self.norm(h))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return (logits, loss, site_stats) if stats else (logits, loss)

    # -------------------------------------------------------------------------
    # Training helpers, as in nanoGPT

    def configure_optimizers(self, weight_decay, learning_rate, betas, routing_lr_scale=1.0):
        """AdamW over the parameters that require grad. Weight decay only on matmul weights: not on norms,
        biases or the routing parameters (a decayed query is pulled back to uniform routing). Every group
        carries an 'lr_scale' that train.py multiplies the scheduled learning rate by: the routing
        parameters can learn faster than the rest (the paper fine-tunes Qwen3 with 5e-3 for the routing
        and 5e-5 for the pretrained weights)."""
        decay, no_decay, routing = [], [], []
        for name, p in self.named_parameters():
            if p.requires_grad:
                (routing if self.is_routing(name) else decay if p.dim() >= 2 else no_decay).append(p)
        groups = [{'params': decay, 'weight_decay': weight_decay, 'lr_scale': 1.0},
                  {'params': no_decay, 'weight_decay': 0.0, 'lr_scale': 1.0},
                  {'params': routing, 'weight_decay': 0.0, 'lr_scale': routing_lr_scale}]
        groups = [dict(g, lr=learning_rate * g['lr_scale']) for g in groups if g['params']]
        # fused (one kernel per step, CPU and GPU alike): it can skip a step on the device (train.py's found_inf)
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=True)

    def compile_regional(self):
        """torch.compile each layer's attention and MLP, not the whole forward: one graph for all attention units and
        one for all MLPs, however deep the model; and the routing math (RoutingOps) on its own, with dynamic shapes, so
        that the routing sites share a few graphs too. The glue between them runs eagerly (train.py, bench.py).
        Returns how many graphs the routing may compile per function: one per number of sources merged (up to the
        largest group) or mixed, with and without gradients. dynamo's default recompile limit (8) would send the rest
        to eager, so the caller raises torch._dynamo.config.recompile_limit to it (a process-wide setting)."""
        for layer in self.layers:
            for unit in (layer.self_attn, layer.mlp):
                unit.compile(fullgraph=True)
        self.routing_ops = RoutingOps(compiled=True)
        return 2 * (max([size for _, size in self.routing_groups or []], default=1) + self.config.n_blocks + 2)

    @staticmethod
    def is_routing(name):
        """Is the parameter (or state-dict entry) of this name a routing parameter: a site's pseudo-query
        (*_res_proj), key norm (*_res_norm) or gate (*_res_gate)?"""
        return '_res_' in name

    def routing_parameters(self):
        """[(pseudo-query, key norm, gate or None)] of every routing site, in forward order."""
        return [site_parameters(self if s.layer is None else self.layers[s.layer], s.kind) for s in self.sites.values()]

    def routing_sources(self):
        """Number of sources each routing site mixes, in forward order (for the FLOP count)."""
        return [s.n + s.open for s in self.sites.values()]

    def flops_per_token(self, T):
        """Training FLOPs (forward + backward) per token: 6N for the matmuls, attention scores as in
        nanoGPT/PaLM, and the routing: per site with N sources the logits (2Nd) and the mix (2Nd)."""
        cfg = self.config
        # the embedding lookup is no matmul, but a tied table is also the LM head, which is one
        matmul_params = self.get_num_params(non_embedding=not cfg.tie_embeddings)
        attention = 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * T
        routing = 3 * sum(4 * n * cfg.n_embd for n in self.routing_sources())
        return 6 * matmul_params + attention + routing

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops):
        """Model FLOPs utilisation: achieved FLOP/s over peak_flops (e.g. device_peak_flops(name))."""
        flops = self.flops_per_token(self.config.block_size) * self.config.block_size * fwdbwd_per_iter
        return flops / dt / peak_flops


# dense BF16 tensor-core peak FLOP/s per GPU (vendor data sheets), for MFU in train.py and bench.py
PEAK_FLOPS = [('H100 PCIe', 756e12), ('H100', 989e12), ('H200', 989e12), ('H800', 989e12), ('A100', 312e12)]


def device_peak_flops(device_name):
    """The first PEAK_FLOPS entry whose key is part of the device name (torch.cuda.get_device_name), or None."""
    return next((flops for key, flops in PEAK_FLOPS if key in device_name), None)
