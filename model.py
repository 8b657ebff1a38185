"""
A Qwen3-style decoder with five residual modes: the standard residual stream, Kimi's Attention
Residuals (Full and Block AttnRes, arXiv 2603.15031) and Delta Attention Residuals (Delta AttnRes and
Delta Block, arXiv 2605.18855). One file, read top to bottom:

1. the routing rule (`route`), the papers' core, in a few lines; when a source is complete (`closes_block`,
   `opens_official_source`), and the routing sites in forward order that this rule gives (`routing_schedule`);
2. the Qwen3 building blocks (RoPE, grouped-query attention with q/k norms, SwiGLU MLP);
3. `GPT.forward`, where the five modes are two switches on one loop:
      which sources are routed   (every sublayer's output, or per-block sums), and
      how the routed mix is used (it REPLACES the sublayer input, or is ADDED to the residual stream);
   `GPT.official_loop` beside it: the authors' code's bookkeeping for the Delta modes (variant='official');
4. the optimizer and MFU helpers; `check_fast_routing`.
The speed machinery is in fast_routing.py: the same numbers as route() with activation memory linear in depth and
each source read once per group of sites. A reader may skip it: `fast_routing = False` (train.py, sample.py; the
attribute GPT.fast_routing) routes with route() alone, and where the fast path runs it has first been checked
against route() (check_fast_routing), so an edited route() is followed or refused, never ignored. model.py and
fast_routing.py import nothing else of this repo (exported directories carry both); Hugging Face checkpoints in
and out: checkpoints.py.
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


# When a source is complete: the one rule that GPT.forward's loops follow and that routing_schedule counts.
#   sublayer modes: every sublayer's output v is a source as soon as the sublayer has run;
#   block modes:    the open block sums its sublayers' outputs and is a source once its last MLP has run
#                   (the model's last block stays open: only the final site, if any, reads it);
#   official:       (variant='official', the Delta modes) the stream a block's first attention read becomes a source
#                   after that attention, as h minus the previous source; Delta AttnRes counts as one block of all
#                   layers, and also completes every sublayer's output.

def closes_block(config, i, kind):
    """Block modes: does sublayer (layer i, 'attn' or 'mlp') complete the open block?"""
    return kind == 'mlp' and (i + 1) % config.layers_per_block == 0 and i + 1 < config.n_layer


def opens_official_source(config, i, kind):
    """variant='official': does the stream that sublayer (i, kind) reads become a source after it (a block's first
    attention; Delta AttnRes: the first attention only)?"""
    period = config.layers_per_block if RESIDUAL_MODES[config.residual][0] == 'block' else config.n_layer
    return kind == 'attn' and i % period == 0


class Site(NamedTuple):
    """One routing site of the schedule (GPT.sites): its place in forward order, its name ('layers.3.attn', 'final'),
    its sublayer (layer None: the final site), and what it mixes: n completed sources, and the open block too if
    open_block."""
    index: int
    name: str
    layer: Optional[int]
    kind: str
    n: int
    open_block: bool


def routing_schedule(config):
    """The routing sites in forward order, counted with the rule above: the one schedule that the parameter order, the
    FLOP count, the two-phase groups and bench.py's traffic model read, and that GPT.forward's loops run."""
    granularity, mixing = RESIDUAL_MODES[config.residual]
    sites, n, open_block = [], 0 if config.official else 1, False   # completed sources (E, unless official)
    for i in range(config.n_layer):
        for kind in ('attn', 'mlp'):
            if config.routed(i, kind):
                sites.append(Site(len(sites), f'layers.{i}.{kind}', i, kind, n, open_block))
            if config.official:
                n += opens_official_source(config, i, kind) + (granularity == 'sublayer')
            elif granularity == 'sublayer':
                n += 1
            elif granularity == 'block':
                closed = closes_block(config, i, kind)
                n, open_block = n + closed, not closed
    if mixing == 'replace':
        sites.append(Site(len(sites), 'final', None, 'final', n, open_block))
    return sites


def query(d):
    """A routing site's pseudo-query w: a bias-free Linear(d, 1), made without drawing from the random generator
    (GPT.init_queries sets it). So a seed gives every mode, variant and gate setting the same draws for everything
    else: the same initial weights as 'standard', and a comparison of modes at one seed differs only in the routing."""
    w = nn.Linear(d, 1, bias=False, device='meta')        # (a meta tensor holds no values: no draw)
    w.weight = nn.Parameter(torch.zeros(1, d))             # zero, the papers' init, until init_queries
    w.is_query = True
    return w


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
            self.add_module(f'{kind}_res_proj', query(d))
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
    fast_routing = True     # False: route() at every site (the rule as written; bench.py's naive baseline)
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
            self.final_res_proj = query(config.n_embd)
            self.final_res_norm = nn.RMSNorm(config.n_embd, eps=config.rms_norm_eps)
        self.site_list = routing_schedule(config)                       # the routing sites, in forward order
        self.sites = {s.name: s for s in self.site_list}
        # two-phase routing (the sublayer modes): its groups of sites, [(first site, number of sites)]
        self.routing_groups = two_phase_schedule(self.sites.values()) if self.granularity == 'sublayer' else None
        cos, sin = rope_tables(config.head_dim, config.block_size, config.rope_theta)
        self.register_buffer('rope_cos', cos, persistent=False)
        self.register_buffer('rope_sin', sin, persistent=False)
        self.apply(self._init_weights)
        self.init_queries(0.0)

    def _init_weights(self, module):
        # Qwen3 from scratch: N(0, 0.02) for Linear and Embedding, norm weights 1 (nn.RMSNorm's default); the
        # pseudo-queries are set by init_queries, without a draw here (see query())
        if isinstance(module, (nn.Linear, nn.Embedding)) and not getattr(module, 'is_query', False):
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
        kv = [None] * self.config.n_layer if kv_cache is None else kv_cache.layers
        site_stats = {}
        record = self.recorder(site_stats if stats else None)
        fast = self.fast_path(record if stats else None)       # None: route() at every site
        replace = self.mixing == 'replace'

        E = self.embed_tokens(idx)
        if self.config.official:
            h = self.official_loop(E, cos, sin, kv, fast, record)
        else:
            h = E               # the residual stream (standard and Delta modes; AttnRes replaces it)
            sources = [E]       # the completed sources: E, then every sublayer's output or every completed block
            block = None        # block modes: the open block, the sum of its sublayers' outputs so far
            for i, layer in enumerate(self.layers):
                for kind, f, proj, norm, gate in layer.sublayers(cos, sin, kv[i]):
                    site = self.sites.get(f'layers.{i}.{kind}')
                    if site is None:                # standard: the sublayer reads the residual stream
                        x = h
                    elif fast is None:              # the rule as written: route(), then REPLACE or ADD
                        mixed, alpha = route(sources + ([] if block is None else [block]), proj, norm)
                        record(site, alpha)
                        x = mixed if replace else h + (mixed if gate is None else gate * mixed)
                    else:                           # the same x, from fast_routing.py (checked against route())
                        x = fast.route(site.index, sources, block, add_to=None if replace else h, gate=gate)
                    v = f(x)
                    if not replace:
                        h = h + v                   # the residual stream is kept
                    if self.granularity == 'sublayer':
                        sources.append(v)           # every sublayer's output is a source
                    elif self.granularity == 'block':
                        block = v if block is None else block + v       # = h(now) - h(block start) in Delta Block
                        if closes_block(self.config, i, kind):
                            sources, block = sources + [block], None    # the block is complete: a source
            if replace:                             # AttnRes: the final norm reads a routed mix too
                site = self.sites['final']
                if fast is None:
                    h, alpha = route(sources + ([] if block is None else [block]), self.final_res_proj,
                                     self.final_res_norm)
                    record(site, alpha)
                else:
                    h = fast.route(site.index, sources, block)

        if kv_cache is not None:
            kv_cache.pos += T
        logits = self.lm_head(self.norm(h))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return (logits, loss, site_stats) if stats else (logits, loss)

    def official_loop(self, E, cos, sin, kv, fast, record):
        """variant='official': the layer loop of the authors' code for the two Delta modes, which produced the
        papers' numbers, beside the paper's loop in forward() (docs/fidelity.md lists the differences):
          - E is not a source from the start, and the first attention is not routed (it reads h = E);
          - a block becomes a source only after the next block's first attention has routed without it, and as
            h - (the previous source) rather than its delta; the first such source is E itself;
          - Delta Block's open block is no source: a site mixes the completed ones only;
          - Delta AttnRes is one block of all layers: E becomes a source after the first attention."""
        h, sources = E, []
        for i, layer in enumerate(self.layers):
            for kind, f, proj, norm, gate in layer.sublayers(cos, sin, kv[i]):
                site = self.sites.get(f'layers.{i}.{kind}')
                if site is None:                    # the first attention
                    x = h
                elif fast is None:
                    mixed, alpha = route(sources, proj, norm)
                    record(site, alpha)
                    x = h + (mixed if gate is None else gate * mixed)
                else:
                    x = fast.route(site.index, sources, None, add_to=h, gate=gate)
                v = f(x)
                if opens_official_source(self.config, i, kind):
                    sources.append(h - sources[-1] if sources else h)  # h: the stream this attention read
                    if fast is not None:    # its logits now, before h moves on (at the next site instead,
                        fast.see(sources)   # autograd would sum the gradients in another order: last bits differ)
                h = h + v
                if self.granularity == 'sublayer':
                    sources.append(v)
        return h

    def recorder(self, stats):
        """record(site, alpha): each site's routing_stats into the dict stats (without gradients), or nothing."""
        def record(site, alpha):
            if stats is not None:
                with torch.no_grad():
                    stats[site.name] = routing_stats(alpha)
        return record

    def fast_path(self, record=None):
        """fast_routing.FastRouting for one forward pass (record: called with each site's weights, or None: no
        statistics, nothing computed for them), or None where this model routes with route() alone
        (fast_routing = False, or 'standard'). Before its first use for a configuration, a process checks that it
        computes what route() does (check_fast_routing)."""
        if not self.fast_routing or not self.sites:
            return None
        if not torch.compiler.is_compiling():
            check_fast_routing(self.config)
        return FastRouting(self.routing_parameters(), self.config.rms_norm_eps, self.routing_groups, self.routing_ops,
                           record=None if record is None else lambda k, alpha: record(self.site_list[k], alpha))

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
        return [s.n + s.open_block for s in self.sites.values()]

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


# -----------------------------------------------------------------------------
# route() is the meaning; fast_routing.py computes the same numbers faster. So that an edited route() is never
# silently ignored, a process checks the fast path against route() before its first use for a configuration.

class FastRoutingMismatch(RuntimeError):
    one_line = True     # a script prints it as one `error:` line (checks.print_mistakes), not as a traceback


_checked = {}           # (mode, variant, gate, route()) -> True once the fast path has matched route()


def check_fast_routing(config):
    """Raise FastRoutingMismatch unless fast_routing.py computes what route() does for this configuration's mode,
    variant and gate: once per process (and per route() function, so an edit made at run time is caught too), on a
    tiny model of its own with random queries and gates, values and gradients in fp32 (about 0.1 s). The
    global random generator is left as it was."""
    key = (config.residual, config.variant, config.res_gate, route)
    if key in _checked:             # (also while the check itself runs its tiny model)
        return
    _checked[key] = False
    tiny = GPTConfig(vocab_size=16, block_size=8, n_layer=5, n_head=2, n_kv_head=1, n_embd=8, head_dim=4,
                     intermediate_size=16, n_blocks=2, residual=config.residual, variant=config.variant,
                     res_gate=config.res_gate)
    results = []
    # fp32 on the CPU with gradients, whatever the caller's context (no_grad, autocast, a meta default device), and
    # its random draws in a generator state of their own
    with (torch.random.fork_rng(devices=[]), torch.device('cpu'), torch.inference_mode(False), torch.enable_grad(),
          torch.autocast('cpu', enabled=False)):
        torch.manual_seed(0)
        model = GPT(tiny)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if GPT.is_routing(name) and not name.endswith('_res_norm.weight'):
                    p.copy_(torch.randn_like(p))        # queries far from uniform routing; gates far from 1
        idx = torch.randint(0, 16, (2, 8))
        for fast in (False, True):
            model.fast_routing = fast
            logits, _ = model(idx)
            grads = torch.autograd.grad((logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum(),
                                        list(model.parameters()))
            results.append([logits, *grads])
    worst = max((a - b).abs().max().item() / (1 + b.abs().max().item()) for a, b in zip(*results))
    if not worst < 1e-4:
        del _checked[key]
        raise FastRoutingMismatch(
            f"route() and fast_routing.py disagree for residual={config.residual!r}, variant={config.variant!r}, "
            f"res_gate={config.res_gate} (relative difference {worst:.2g} in values or gradients): the fast path "
            f"computes the routing rule as shipped. To train your edited route(), set fast_routing=False (train.py, "
            f"sample.py: --fast_routing=False; bench.py: --routing=naive), or make fast_routing.py compute the same.")
    _checked[key] = True


# dense BF16 tensor-core peak FLOP/s per GPU (vendor data sheets), for MFU in train.py and bench.py
PEAK_FLOPS = [('H100 PCIe', 756e12), ('H100', 989e12), ('H200', 989e12), ('H800', 989e12), ('A100', 312e12)]


def device_peak_flops(device_name):
    """The first PEAK_FLOPS entry whose key is part of the device name (torch.cuda.get_device_name), or None."""
    return next((flops for key, flops in PEAK_FLOPS if key in device_name), None)
