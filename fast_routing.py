"""
The routing's speed machinery: what GPT.forward's loop calls in place of the routing rule, model.route(), for the
same sublayer input at a fraction of its memory and memory traffic. A reader learning the method may skip this
file: `fast_routing = False` routes every site with route() itself. model.check_fast_routing compares the two before
a process first uses this path (an edited route() is refused, not ignored), and test_bench.py checks that both agree
in values and gradients (eager, compiled, BF16, DDP / FSDP2). docs/routing.md derives what is here.

1. `keys` and `mix`: each source's logits at every later site computed once, when the source is completed, and a
   site only mixes; activation memory linear in depth;
2. two-phase routing (`_Prefix`, `_Merge`) for the sublayer modes: each source read once per group of sites, the
   groups chosen by `two_phase_groups` to minimise the modelled traffic (`group_passes`, which bench.py shares) and
   laid on the model's schedule of sites by `two_phase_schedule`;
3. `RoutingOps`: that math compiled apart for GPT.compile_regional;
4. `FastRouting`: the state of one forward pass on this path.
It imports nothing of this repo either: exported Hugging Face directories carry it beside model.py.
"""
import functools
import math

import torch

# The same routing without its costs. route() stacks the N sources at every site, and autograd keeps that
# stack (and RMSNorm's input and output, more copies of it) for the backward pass: with a site per sublayer
# that is O(L^2) activation memory, and most of the papers' measured cost of Delta AttnRes. The logit splits
# into a part per site and a part per source:
#
#     w . RMSNorm_g(s_i) = (w * g) . s_i * r_i,     r_i = 1/rms(s_i) = rsqrt(mean(s_i^2) + eps)
#
# u = w * g is a parameter of the site, known before the forward pass. So when a source is completed, its
# logits at every later site are one product (`keys`: z_i = (s_i @ U^T) * r_i, U = the u of those sites), and
# a site only mixes (`mix`): out = sum_i softmax_i(z_i[site]) s_i, with plain autograd ops that keep the sources
# themselves for backward (no stack, no copies): each source is kept once, whatever the number of sites that
# read it. The fast path is tested equal to route() in values and gradients (test_bench.py).

def rms_inv(s, eps):
    """1/rms(s) over the last dim, in fp32. vector_norm saves s itself (not an fp32 copy) for backward."""
    return torch.rsqrt(torch.linalg.vector_norm(s, dim=-1, dtype=torch.float32).square() / s.shape[-1] + eps)


def keys(s, U, eps, ops=None):
    """(B, T, sites) fp32: source s's logit at each site whose u = w * g is a row of U."""
    ops = ops or EAGER
    r = rms_inv(s, eps)
    if torch.is_grad_enabled() and (s.requires_grad or U.requires_grad):
        return _Keys.apply(s, U, r, ops)
    # nothing to differentiate (evaluation, sampling): the same math, saving nothing
    with torch.autocast(s.device.type, enabled=False):
        return ops.keys(s, U, r)


def _keys(s, U, r):
    return (s.float() @ U.float().T) * r.unsqueeze(-1)                      # (B, T, sites)


def _keys_grad(s, U, r, g):
    dots = s.float() @ U.float().T                                          # recomputed: one read of s
    g_dots = g * r.unsqueeze(-1)
    g_s = (g_dots @ U.float()).to(s.dtype)
    g_U = (g_dots.reshape(-1, g.shape[-1]).T @ s.reshape(-1, s.shape[-1]).float()).to(U.dtype)
    return g_s, g_U, (g * dots).sum(-1)


class _Keys(torch.autograd.Function):
    # z = (s @ U^T) * r in fp32, under autocast too (the logits decide the weights), saving s itself for backward:
    # plain ops would save an fp32 copy of a BF16 source, and the sources are most of what routing keeps.

    @staticmethod
    def forward(ctx, s, U, r, ops):
        ctx.save_for_backward(s, U, r)
        ctx.ops = ops
        with torch.autocast(s.device.type, enabled=False):
            return ops.keys(s, U, r)

    @staticmethod
    def backward(ctx, g):
        with torch.autocast(g.device.type, enabled=False):
            return *ctx.ops.keys_grad(*ctx.saved_tensors, g), None


def mix(logits, sources):
    """(sum_i alpha_i s_i, alpha), alpha = softmax over the N sources of logits (N, B, T), in fp32."""
    alpha = logits.softmax(dim=0)
    out = alpha[0].unsqueeze(-1) * sources[0]
    for a, s in zip(alpha[1:], sources[1:]):
        out = torch.addcmul(out, a.unsqueeze(-1), s)
    return out, alpha


# Two-phase routing (the sublayer modes: a site per sublayer, every earlier sublayer's output a source, O(L^2) reads
# in the mix above). The sites come in groups (chosen below). Phase 1, at a group's first site: the sources
# completed so far, mixed for every site of the group in one pass, o_k = sum_i beta_ki s_i with beta_k = softmax of
# their logits at site k, and lse_k = logsumexp of those logits. Phase 2, at each site k: the few sources completed
# since join in, as if o_k were one more source with logit lse_k,
#
#     (c, a_1..a_e) = softmax(lse_k, z_1..z_e),    out = c * o_k + sum_j a_j s_j,    x = h + gate * out  (or x = out)
#
# which is exactly softmax over all of the site's logits. Backward, every logit's gradient is
# alpha_i * (<s_i, dL/dout> - m) with m = <out, dL/dout>, and m comes from what the sublayer's RMSNorm keeps
# anyway: x (replace: out = x; add: out * gate = x - h, with h rebuilt from the group's first h and the sources
# completed since, the same additions in the same order). Phase 2 runs its backward first but cannot compute
# phase 1's sources' part, so the two Functions agree on what flows between them: phase 2 returns -c * m as the
# "gradient" of lse_k and c * dL/dx as that of o_k (without the gate), and phase 1 finishes the logits' gradients
# from the products it computes anyway (docs/routing.md). Saved: the sources (once), the group's first h, the
# weights; no per-site copy.

# The groups: a group of G sites whose first site mixes n sources costs, per token of a training step, about
# 10n + 5G passes over a B x T x d tensor for phase 1 (forward and backward) and 10 + 6e for phase 2 at each site
# that merges e sources (bench.py's traffic model, derived op by op in docs/routing.md). Large groups re-read the
# sources less often, small ones merge fewer: the groups that minimise the sum grow with depth, about sqrt(10n/3)
# sites (Delta AttnRes at 36 layers: 3, 5, 6, 8, 10, 11, 13, 15), and cost 9% less than groups of a constant
# sqrt(sites).

def group_passes(n):
    """Modelled traffic of one group of two-phase sites, n = the sources each of them mixes, in order."""
    return 10 * n[0] + 5 * len(n) + sum(10 + 6 * (m - n[0]) for m in n)


def two_phase_groups(n):
    """The sizes of the groups, in order, that minimise the summed group_passes of sites mixing n[0], n[1], ...
    sources (dynamic programming over where the last group starts)."""
    best, start = [0] + [math.inf] * len(n), [0] * (len(n) + 1)    # the cheapest schedule of the first b sites
    for b in range(1, len(n) + 1):
        best[b], start[b] = min((best[a] + group_passes(n[a:b]), a) for a in range(b))
    sizes, b = [], len(n)
    while b:
        sizes.append(b - start[b])
        b = start[b]
    return sizes[::-1]


def two_phase_schedule(sites):
    """[(first site, number of sites)] of each two-phase group, over the sites (model.Site, in forward order) that mix
    more than one source: a site that sees E alone has nothing to share, and routes by keys + mix."""
    shared = [s for s in sites if s.n + s.open_block > 1]
    groups, first = [], shared[0].index if shared else 0
    for size in two_phase_groups([s.n for s in shared]):
        groups.append((first, size))
        first += size
    return groups


def _promoted(tensors):
    return functools.reduce(torch.promote_types, [t.dtype for t in tensors])


def _stack(sources):
    dtype = _promoted(sources)
    return torch.stack([s.to(dtype) for s in sources], -2)                          # (B, T, N, d)


def _prefix(Z, S):
    """Phase 1: Z (B, T, G, N) fp32 logits of N sources S (B, T, N, d) at G sites -> o (B, T, G, d), beta, lse (B, T, G)."""
    beta = Z.softmax(-1)
    return beta.to(S.dtype) @ S, beta, Z.logsumexp(-1)


def _prefix_grad(beta, gates, S, dO, lam):
    """Phase 1 backward: dO (B, T, G, d) = c * dL/dx per site, lam (B, T, G) = -c * m per site -> dZ, dgates, dS."""
    D = (dO @ S.transpose(-1, -2)).float()                                          # <s_i, c dL/dx>  (B, T, G, N)
    g = 1 if gates is None else gates.float()[:, None]
    dZ = beta * (g * D + lam.unsqueeze(-1))                                         # alpha_i (<s_i, dL/dout> - m)
    dS = (beta * g).to(S.dtype).transpose(-1, -2) @ dO                              # (B, T, N, d)
    return dZ, None if gates is None else (beta * D).sum((0, 1, 3)).to(gates.dtype), dS


def _merge(o, lse, z, h, gate, inner):
    """Phase 2: o, lse of the site; z (B, T, e) logits of the e sources completed since (inner); h the group's first
    residual stream (None: replace) -> x, the weights (c, a_1..a_e)."""
    w = torch.cat([lse.unsqueeze(-1), z], -1).softmax(-1)                         # (c, a_1..a_e)
    out = w[..., :1] * o
    for j, s in enumerate(inner):
        out = torch.addcmul(out, w[..., j + 1:j + 2], s)
    out = out.to(_promoted([o, *inner]))
    if h is None:
        return out, w                                                               # replace: x = out
    h = sum(inner, h)                        # h at this site: the model's own additions, in its order (same bits)
    return h + (out if gate is None else gate * out), w


def _merge_grad(x, w, h, gate, inner, gx):
    """Phase 2 backward -> the gradients of o, lse, z, h, gate (this phase's part) and the inner sources."""
    dot = lambda a, b: torch.linalg.vecdot(a.float(), b.float())
    m = dot(x, gx) if h is None else dot(x - sum(inner, h), gx)   # m = <out, dL/dout>: replace, out = x; add, gate * out = x - h
    gout = gx if gate is None else gate * gx
    c, a = w[..., 0], w[..., 1:]
    Dx = torch.stack([dot(s, gx) for s in inner], -1) if inner else torch.zeros_like(a)    # (B, T, e)
    dz = a * ((Dx if gate is None else gate.float() * Dx) - m.unsqueeze(-1))
    # h = (the group's first h) + the inner sources: dL/dx reaches them both ways in the additive modes
    dinner = [(a[..., j:j + 1] * gout + (0 if h is None else gx)).to(s.dtype) for j, s in enumerate(inner)]
    dgate = None if gate is None else (a * Dx).sum().reshape(gate.shape).to(gate.dtype)  # this phase's part
    return c.unsqueeze(-1).to(gx.dtype) * gx, -c * m, dz, None if h is None else gx, dgate, *dinner


class _Prefix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Z, gates, ops, *sources):
        with torch.autocast(Z.device.type, enabled=False):
            o, beta, lse = ops.prefix(Z, _stack(sources))
        ctx.save_for_backward(beta, gates, *sources)
        ctx.ops = ops
        return (*o.unbind(-2), *lse.unbind(-1))

    @staticmethod
    def backward(ctx, *grads):
        beta, gates, *sources = ctx.saved_tensors
        G = beta.shape[-2]
        with torch.autocast(beta.device.type, enabled=False):
            S = _stack(sources)
            dO, lam = torch.stack(grads[:G], -2).to(S.dtype), torch.stack(grads[G:], -1)
            dZ, dgates, dS = ctx.ops.prefix_grad(beta, gates, S, dO, lam)
        return (dZ, dgates, None, *(d.to(s.dtype) for d, s in zip(dS.unbind(-2), sources)))


class _Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o, lse, z, h, gate, ops, *inner):
        with torch.autocast(o.device.type, enabled=False):
            x, w = ops.merge(o, lse, z, h, gate, inner)
        ctx.save_for_backward(x, w, h, gate, *inner)
        ctx.ops = ops
        return x

    @staticmethod
    def backward(ctx, gx):
        x, w, h, gate, *inner = ctx.saved_tensors
        with torch.autocast(gx.device.type, enabled=False):
            do, dlse, dz, dh, dgate, *dinner = ctx.ops.merge_grad(x, w, h, gate, inner, gx)
        return do, dlse, dz, dh, dgate, None, *dinner


class RoutingOps:
    """The routing's tensor math, which the Functions above and FastRouting call: as written (EAGER, and inside a model
    compiled whole, where it fuses with its neighbours), or each function compiled on its own with dynamic shapes
    (GPT.compile_regional): then the numbers of sources and sites are symbols in the graphs, not constants, and
    however deep the model its routing sites share a few graphs (one per number of sources a site merges in phase 2
    or mixes, which grows with the largest group: about sqrt(depth), not depth^2)."""

    def __init__(self, compiled=False):
        # Inside the Functions the math needs no autograd: its inputs go in detached, so that training and evaluation
        # run one graph (dynamo would compile another for inputs that require grad). mix is differentiated through.
        wrap = (lambda f: torch.compile(f, dynamic=True, fullgraph=True)) if compiled else (lambda f: f)
        self.mix = wrap(mix)
        for name, f in (('keys', _keys), ('keys_grad', _keys_grad), ('prefix', _prefix),
                        ('prefix_grad', _prefix_grad), ('merge', _merge), ('merge_grad', _merge_grad)):
            setattr(self, name, functools.partial(_detached, wrap(f)) if compiled else f)


def _detached(f, *args):
    def detach(a):
        if isinstance(a, (list, tuple)):
            return type(a)(map(detach, a))
        return a.detach() if isinstance(a, torch.Tensor) else a
    return f(*map(detach, args))


EAGER = RoutingOps()


class FastRouting:
    """The fast path's state for one forward pass, which GPT.forward's loop calls at each site:
        keys     [(first site, keys(source))] of each completed source: its logits at every later site
        phase1   two-phase routing: (number of sources, h, o, lse) of the open group
        next     the site after the last one routed: a source completed now is read from there on
        sources  the loop's completed sources, in the autocast dtype (see)
        seen     how many of the loop's sources have their keys
    sites: [(proj, norm, gate)] of every routing site in forward order (their u = w * g, for the keys); groups (the
    sublayer modes): route in two phases, in these groups of sites [(first site, size)] (two_phase_schedule); ops: the
    routing math (EAGER, or compiled once for every site: GPT.compile_regional); record(site, alpha): called with
    each site's weights (for routing_stats), or None."""

    def __init__(self, sites, eps, groups=None, ops=EAGER, record=None):
        self.ops, self.eps, self.keys, self.phase1, self.next, self.seen = ops, eps, [], None, 0, 0
        self.sources = []
        self.record = record
        self.U = torch.stack([p.weight[0] * n.weight for p, n, _ in sites]) if sites else None
        self.gates = [g for _, _, g in sites]
        self.group = {k: (first, size) for first, size in groups or [] for k in range(first, first + size)}

    def see(self, sources):
        """The sources completed since the last call: kept in the autocast dtype, and their logits at every site from
        self.next on. Under BF16 autocast the sublayers' outputs are BF16 already, but the embedding E (and the
        official variant's h - source) are fp32: stacked with BF16 sources they would make every two-phase stack
        fp32, twice the routing traffic. route() rounds them to BF16 anyway, where autocast feeds its logits'
        Linear and its mix's einsum."""
        new = sources[self.seen:]
        device = new[0].device.type if new else 'cpu'
        low = torch.get_autocast_dtype(device) if new and torch.is_autocast_enabled(device) else None
        for s in new:
            s = s.to(low) if low is not None and s.dtype == torch.float32 else s
            self.sources.append(s)
            if self.U is not None and self.next < len(self.U):     # (a source no later site reads needs no keys)
                # (contiguous: a slice's offset would be one more shape for the compiled ops to specialise on)
                self.keys.append((self.next, keys(s, self.U[self.next:].contiguous(), self.eps, self.ops)))
        self.seen = len(sources)

    def route(self, k, sources, block=None, add_to=None, gate=None):
        """Site k's sublayer input, as GPT.forward's loop computes it with route(): over the completed sources and the
        open block (None: none), x = sum_i alpha_i s_i, or with add_to=h, x = h + gate * sum_i alpha_i s_i."""
        self.next = k
        self.see(sources)
        self.next, sources = k + 1, self.sources
        if k in self.group:
            x = self.two_phase(k, sources, add_to, gate)
            if self.record:
                with torch.no_grad():
                    self.record(k, self.weights(k))
            return x
        h, srcs = add_to, sources + ([] if block is None else [block])
        logits = [z[..., k - first] for first, z in self.keys]
        if block is not None:      # the open block changes at every site: its logit here only
            logits.append(keys(block, self.U[k:k + 1], self.eps, self.ops)[..., 0])
        out, alpha = self.ops.mix(torch.stack(logits), srcs)
        out = out.to(torch.get_autocast_dtype(out.device.type) if torch.is_autocast_enabled(out.device.type)
                     else _promoted(srcs))                                          # route()'s dtype
        if self.record:
            self.record(k, alpha)
        return out if h is None else h + (out if gate is None else gate * out)

    def weights(self, k):
        """Site k's weights over all of its sources (two-phase routing never forms them), for the statistics."""
        return torch.stack([z[..., k - first] for first, z in self.keys]).softmax(0)

    def two_phase(self, k, sources, h, gate):
        # the Functions where there is something to differentiate; else (evaluation, sampling) the math, saving nothing
        grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (*sources, self.U, h, gate))
        first, G = self.group[k]
        if k == first:                                                      # phase 1, at a group's first site
            Z = torch.stack([z[..., k - f:k - f + G] for f, z in self.keys], -1)                  # (B, T, G, N)
            gates = None if gate is None else torch.cat(self.gates[k:k + G])
            if grad:
                res = _Prefix.apply(Z, gates, self.ops, *sources)
                o, lse = res[:G], res[G:]
            else:
                o, _, lse = self.ops.prefix(Z, _stack(sources))
                o, lse = o.unbind(-2), lse.unbind(-1)
            self.phase1 = (len(sources), h, o, lse)
        n, h0, o, lse = self.phase1
        inner = sources[n:]                                         # completed inside the group
        z = (torch.stack([zi[..., k - f] for f, zi in self.keys[n:]], -1) if inner
             else lse[0].new_zeros(*lse[0].shape, 0))
        if grad:
            return _Merge.apply(o[k - first], lse[k - first], z, h0, gate, self.ops, *inner)
        return self.ops.merge(o[k - first], lse[k - first], z, h0, gate, tuple(inner))[0]   # (a tuple, as in _Merge)
