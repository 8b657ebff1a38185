"""
Benchmark full training steps (forward, backward, AdamW step) of the residual modes side by side.

    python bench.py [config/x.py] [--key=value ...]
    python bench.py --residual=delta_attnres --n_layer=24
    python bench.py config/delta_block_220m.py --residual=delta_block,delta_attnres   # on a GPU: 220m, compile + BF16
    python bench.py --routing=both          # also the plain stack-per-site route(): what the fast path buys
    python bench.py --json                  # one JSON document on stdout instead of the table

Synthetic random tokens; `warmup` steps per mode are not counted (they include torch.compile). Then
`repeats` rounds, each timing `steps` steps of every mode in turn (A B C A B C ...), so that the ratios
hold on a noisy machine. Columns:
  tok/s            training throughput, median over the rounds
  paired x, range  speed against 'standard' within each round (the two ran back to back): the median over the
                   rounds of that round's ratio, and the lowest and highest; a wide range means the machine's
                   load changed. On a noisy machine it can differ from the ratio of two tok/s medians, which
                   may come from different rounds: the paired ratio is the one to trust
  peak MB, x       GPU: torch.cuda.max_memory_allocated of the mode's step, counted as if the mode's
                   model were alone on the device (its own parameters and optimizer state included).
                   CPU: not measured (process RSS is noise); see the saved column.
  saved MB, x      activations saved for backward by one training forward: every tensor that autograd
                   packs (torch.autograd.graph.saved_tensors_hooks), each storage counted once, the
                   parameters left out. Measured in eager mode, outside the timing.
  MFU              GPU: model FLOPs (GPT.flops_per_token) per second over the device's peak BF16 dense
                   FLOP/s (model.PEAK_FLOPS, or --peak_flops=...).
  1st step s       the mode's first training step: with compile, its compile time (forward and backward)
                   from a cold start (cold_compile: inductor's on-disk caches off, a fresh cache folder) for the
                   first row only: a later row reuses the kernels earlier rows compiled in this process (the layers
                   are the same code in every mode; with compile_regional, the same graphs). A mode's cold compile:
                   list it first, e.g. --residual=delta_attnres,standard (standard is added first only if missing)
Then the routing's modelled memory traffic (routing_traffic, docs/routing.md) at this shape and at the
paper's 1b shape: what route() (the naive baseline), keys + mix and the two-phase schedule (which the model runs
for the sublayer modes) read and write per token. Last, that traffic at this device's measured
bandwidth (stream_bandwidth: c = a + b over tensors larger than the caches): the time it adds to a step if
moving it were all the routing cost, and the 'x std' that leaves at best, beside the measured one. A measured
ratio near that bound says the implementation runs at its schedule's traffic; only less traffic goes faster.
"""

import atexit
import contextlib
import json as jsonlib
import os
import shutil
import statistics
import sys
import tempfile
import time

from checks import InvalidValue, check_settings, print_mistakes

# -----------------------------------------------------------------------------
# settings; the defaults are a shape a 2-core CPU measures in minutes (d=256, L=12, T=256, batch 4)
residual = 'all'            # 'all', one of model.RESIDUAL_MODES, or several joined by commas (in that order; 'standard'
                            # is added first where missing)
routing = 'fast'            # 'fast' (fast_routing.py, the model's default), 'naive' (model.route() at every site:
                            # the rule as written) or 'both'
n_layer = 12
n_head = 4
n_kv_head = 2
n_embd = 256
head_dim = 64
intermediate_size = 1024
n_blocks = 4
variant = 'paper'           # 'paper' or 'official' (the authors' code's bookkeeping for the Delta modes)
vocab_size = 50304
block_size = 256            # sequence length of every step
batch_size = 4
warmup = 2                  # untimed steps per mode (compilation happens here)
repeats = 5                 # timed rounds; the median is reported
steps = 2                   # training steps per mode per round
learning_rate = 6e-4
weight_decay = 0.1
device = None               # None: 'cuda' where torch sees a GPU, else 'cpu'
dtype = None                # autocast dtype, 'float32' = none; None: 'bfloat16' on a GPU that has it, else 'float32'
compile = None              # torch.compile each model; None: on a GPU
compile_regional = False    # with compile: each layer's attention and MLP, and the routing math apart (train.py's compile_regional)
cold_compile = True         # with compile: inductor's on-disk caches off, so '1st step s' is a cold compile
peak_flops = 0.0            # device peak FLOP/s for MFU; 0 = look the device up in model.PEAK_FLOPS
seed = 1337
json = False                # print one JSON document instead of the table
_config_file_extras_ok = True   # train.py's config files also set out_dir, dataset, ...: not ours
if __name__ == '__main__':
    print_mistakes()    # a mistake in a setting: one line (checks.py); a bug: its traceback
# a bare --json means --json=True; configurator.py prints its overrides, which must not spoil --json output
sys.argv = [('--json=True' if a == '--json' else a) for a in sys.argv]
with contextlib.redirect_stdout(sys.stderr if any(a == '--json=True' for a in sys.argv) else sys.stdout):
    exec(open(os.path.join(os.path.dirname(__file__), 'configurator.py')).read())
# -----------------------------------------------------------------------------
# torch and the modules that import it load only now, so that --help (configurator.py) answers at once
import torch
from tqdm import tqdm

from fast_routing import group_passes
from model import GPT, GPTConfig, RESIDUAL_MODES, check_fast_routing, device_peak_flops

gpu = torch.cuda.is_available()     # None: what suits this machine
device = ('cuda' if gpu else 'cpu') if device is None else device
dtype = ('bfloat16' if gpu and torch.cuda.is_bf16_supported() else 'float32') if dtype is None else dtype
compile = gpu if compile is None else compile

# -----------------------------------------------------------------------------
# The routing's memory traffic, modelled per token of one training step (forward + backward), in passes over a
# B x T x d tensor (one read or one write of a source-sized tensor); docs/routing.md derives each term op by op.
#   route()       the naive baseline (--routing=naive, GPT.fast_routing = False): per site with N sources 19N + 3
#                 (stack, RMSNorm of the stack, logits, mix; their backward)
#   keys + mix    the fast path now (fast_routing.FastRouting): per site 8N + 1 (mix; backward), per source 10 (its logits at
#                 every later site, one [B*T, d] x [d, sites] product, its 1/rms, and their backward)
#   two-phase     what fast_routing.FastRouting runs for the sublayer modes: per group of G sites over the n sources completed
#                 before it 10n + 5G (phase 1, one pass for all G sites: stack and product, their backward, the
#                 sources' gradients); per site merging the e sources completed since: 10 + 6e (phase 2, h rebuilt);
#                 per source 10 (its keys, as above); a first site that sees E alone mixes alone (keys + mix). The
#                 groups are fast_routing.two_phase_groups (the sizes that minimise this sum: fast_routing.group_passes). The
#                 block modes keep keys + mix (a handful of sources per site): their two-phase column is keys + mix.
TRAFFIC = {
    'route':      dict(site=lambda N: 19 * N + 3, source=0),
    'keys_mix':   dict(site=lambda N: 8 * N + 1, source=10),
}


def routing_traffic(model, bytes_per_element):
    """{schedule: bytes per token} of the model's routing for route(), keys + mix and two-phase, from its schedule of
    sites (GPT.sites: each site's completed sources n, and open_block if the open block is a source too) and its
    two-phase groups (GPT.routing_groups; None: the block modes, whose two-phase column is keys + mix)."""
    sites = list(model.sites.values())
    n_sources = sites[-1].n
    passes = {name: sum(t['site'](s.n + s.open_block) for s in sites) + t['source'] * n_sources for name, t in TRAFFIC.items()}
    passes['two_phase'] = passes['keys_mix']
    if model.routing_groups is not None:
        grouped = [sites[first:first + size] for first, size in model.routing_groups]
        alone = [s.n for s in sites if not any(s in g for g in grouped)]     # sees E only: keys + mix
        passes['two_phase'] = (sum(TRAFFIC['keys_mix']['site'](n) for n in alone) + 10 * n_sources
                               + sum(group_passes([s.n for s in g]) for g in grouped))
    return {name: p * model.config.n_embd * bytes_per_element for name, p in passes.items()}


def stream_bandwidth(n=2**25, rounds=5):
    """Bytes per second one memory-bound pass moves here: the best of a few c = a + b over n elements of the
    bench's dtype (3n elements read and written; n large enough that no cache holds them)."""
    dt = getattr(torch, dtype)
    a, b, c = (torch.rand(n, device=device).to(dt) for _ in range(3))
    best = float('inf')
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        torch.add(a, b, out=c)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 3 * n * c.element_size() / best


def peak_flops_here():
    if peak_flops:
        return peak_flops
    if device.startswith('cuda') and dtype == 'bfloat16':
        return device_peak_flops(torch.cuda.get_device_name(device))
    return None     # no table entry for CPUs, or for FP32 training


def sync():
    if device.startswith('cuda'):
        torch.cuda.synchronize(device)


def own_resident_bytes(model, optimizer):
    """Bytes of a mode's own tensors that live across steps: parameters and AdamW state."""
    tensors = list(model.parameters()) + [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def saved_activation_bytes(model, x, y, ctx):
    """Bytes autograd saves for backward in one training forward: each storage once, parameters out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx:
        _, loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def build(mode, rt, x, y, ctx):
    """One mode's model, compiled as asked and warmed up -> its row: what is measured once (parameters, saved
    activations, the first step's time: with compile, the compile time) and its training step, timed later."""
    try:
        cfg = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                        n_kv_head=n_kv_head, n_embd=n_embd, head_dim=head_dim,
                        intermediate_size=intermediate_size, residual=mode, n_blocks=n_blocks, variant=variant)
    except ValueError as e:     # the shape, checked by model.py (which imports nothing of this repo)
        raise InvalidValue(str(e)) from None
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    model.fast_routing = rt == 'fast'
    if model.fast_routing:      # (before anything is measured; once per mode, about 0.1 s)
        check_fast_routing(cfg)
    optimizer = model.configure_optimizers(weight_decay, learning_rate, (0.9, 0.95))
    saved = saved_activation_bytes(model, x, y, ctx)
    fwd = torch.compile(model) if compile and not compile_regional else model
    if compile and compile_regional:
        graphs = model.compile_regional()    # the routing's graphs per function: dynamo's limit must allow them
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs)

    def step():
        with ctx:
            _, loss = fwd(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    sync()
    t0 = time.perf_counter()
    step()                                      # with compile: compiles forward and backward
    sync()
    first_step = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    sync()
    return dict(mode=mode, routing=rt, params=model.get_num_params(), saved_bytes=saved, first_step_s=first_step,
                step=step, model=model, optimizer=optimizer, times=[], peak_bytes=None,
                flops_per_token=model.flops_per_token(block_size))


def time_rounds(rows):
    """`repeats` rounds, each timing `steps` steps of every model in turn (A B C A B C ...): row['times'], and on a
    GPU row['peak_bytes'], as if the model were alone on the device."""
    for _ in tqdm(range(repeats), desc=f'timed rounds of {len(rows)} models', unit='round'):
        for row in rows:
            peak_base = None
            if device.startswith('cuda'):
                torch.cuda.reset_peak_memory_stats(device)
                peak_base = torch.cuda.memory_allocated(device)
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                row['step']()
            sync()
            row['times'].append(time.perf_counter() - t0)
            if peak_base is not None:   # the other modes' resident models are in the base; count only this one's
                peak = torch.cuda.max_memory_allocated(device) - peak_base + own_resident_bytes(row['model'], row['optimizer'])
                row['peak_bytes'] = max(row['peak_bytes'] or 0, peak)


def summarize(rows, std, peak):
    """Throughput, MFU and the ratios to standard (`std`'s row), paired by round."""
    tokens = steps * batch_size * block_size
    for row in rows:
        row['seconds_per_step'] = statistics.median(row['times']) / steps
        row['tok_per_s'] = tokens / statistics.median(row['times'])
        row['mfu'] = row['flops_per_token'] * row['tok_per_s'] / peak if peak else None
    for row in rows:
        per_round = [t_std / t for t_std, t in zip(std['times'], row['times'])]
        row['tok_per_s_ratio'] = statistics.median(per_round)
        row['tok_per_s_ratio_range'] = [min(per_round), max(per_round)]
        row['round_spread'] = round_spread(row['times'], std['times'])
        row['saved_ratio'] = row['saved_bytes'] / std['saved_bytes']
        row['peak_ratio'] = row['peak_bytes'] / std['peak_bytes'] if row['peak_bytes'] else None
        for k in ('step', 'model', 'optimizer'):
            del row[k]


NOISE = 1.25     # a model whose rounds disagree by this factor or more: the machine's load changed


def round_spread(times, std_times):
    """How much a model's rounds disagree, 1.0 when they agree: its slowest round / its fastest, or the same for its
    time relative to standard's in the same round, whichever is larger (a load that came and went shows in the first;
    one that hit some models' turns in a round and not others', in the second)."""
    ratios = [t / t_std for t_std, t in zip(std_times, times)]
    return max(max(times) / min(times), max(ratios) / min(ratios))


def noise_warning(rows):
    """One line when the rounds disagree too much for the table's speeds and ratios to mean anything (another job
    took the cores for part of the run, say), else None."""
    noisy = [r for r in rows if r['round_spread'] > NOISE]
    if not noisy:
        return None
    worst = max(noisy, key=lambda r: r['round_spread'])
    return (f"WARNING: the rounds disagree: {len(noisy)} of {len(rows)} models ran up to {worst['round_spread']:.1f}x "
            f"slower in one round than in another, alone or against standard ({worst['mode']}; over {NOISE}x counts "
            f"as noise), so this machine's "
            f"load changed while it ran and these speeds and ratios cannot be trusted. Run again on an idle machine "
            f"(on a shared CPU, OMP_NUM_THREADS=1 or fewer threads than free cores), or with more --repeats.")


def modelled_traffic(modes):
    """The modelled routing traffic of each routed mode at this shape and at the paper's 1b shape (d=1280, 36 layers,
    4 blocks, BF16) -> (shapes, {shape: {mode: routing_traffic}})."""
    shapes = {'this': (n_layer, n_embd, n_blocks, 2 if dtype in ('bfloat16', 'float16') else 4), '1b': (36, 1280, 4, 2)}
    with torch.device('meta'):      # the shapes only: no memory
        model = lambda m, L, d, nb: GPT(GPTConfig(vocab_size=8, n_layer=L, n_embd=d, n_head=1, n_kv_head=1, head_dim=8,
                                                  intermediate_size=8, residual=m, n_blocks=nb, variant=variant))
        traffic = {shape: {m: routing_traffic(model(m, L, d, nb), b) for m in modes if m != 'standard'}
                   for shape, (L, d, nb, b) in shapes.items()}
    return shapes, traffic


def print_tables(setup, rows, shapes, traffic, std):
    """The three tables: measured speed and memory, the modelled traffic, and that traffic's bound on speed."""
    print(f"# {setup['device']}, torch {setup['torch']}, {dtype}, compile={compile}{' (regional)' * (compile and compile_regional)}; L={n_layer} d={n_embd} "
          f"T={block_size} batch={batch_size} vocab={vocab_size} n_blocks={n_blocks}; "
          f"median of {repeats} interleaved rounds of {steps} steps")
    print(f"# saved = {setup['saved']}" + (f"; peak = {setup['peak']}" if setup['peak'] else
                                           "; peak: CPU, not measured"))
    print("# paired x: the median over rounds of standard's time / the mode's in the same round; x: / standard's")
    head = (f"{'mode':<22} {'params':>8} {'tok/s':>9} {'paired x':>8} {'range':>9} {'peak MB':>9} {'x':>6} "
            f"{'saved MB':>9} {'x':>6} {'MFU':>6} {'1st step s':>10}")
    print(head)
    print('-' * len(head))
    for row in rows:
        name = row['mode'] + (' (naive)' if row['routing'] == 'naive' else '')
        peak_s = (f"{row['peak_bytes'] / 2**20:9.1f} {row['peak_ratio']:6.2f}" if row['peak_bytes'] else f"{'-':>9} {'-':>6}")
        mfu_s = f"{100 * row['mfu']:5.1f}%" if row['mfu'] is not None else f"{'-':>6}"
        lo, hi = row['tok_per_s_ratio_range']
        print(f"{name:<22} {row['params'] / 1e6:7.2f}M {row['tok_per_s']:9.0f} {row['tok_per_s_ratio']:8.2f} {lo:4.2f}-{hi:4.2f} {peak_s} "
              f"{row['saved_bytes'] / 2**20:9.1f} {row['saved_ratio']:6.2f} {mfu_s} {row['first_step_s']:10.1f}")
    if warning := noise_warning(rows):
        print(warning)
    print("\n# routing traffic per token of a training step, modelled (docs/routing.md): MB read + written")
    print(f"{'mode':<22} {'shape':<20} {'route()':>9} {'keys+mix':>9} {'two-phase':>9} {'route()/two-phase':>17}")
    for shape, (L, d, nb, b) in shapes.items():
        for m, t in traffic[shape].items():
            print(f"{m:<22} {f'L={L} d={d} {8 * b}-bit':<20} {t['route'] / 1e6:9.2f} "
                  f"{t['keys_mix'] / 1e6:9.2f} {t['two_phase'] / 1e6:9.2f} {t['route'] / t['two_phase']:17.1f}")
    routed = [row for row in rows if row['mode'] != 'standard']
    if not routed:
        return
    bandwidth = setup['bandwidth']
    print(f"\n# that traffic at this device's bandwidth ({bandwidth / 1e9:.1f} GB/s, c = a + b): the time it adds to a step at "
          f"this shape,\n# and the x std that leaves at best (standard: {1e3 * std['seconds_per_step']:.0f} ms/step)")
    print(f"{'mode':<22} {'routing':>10} {'MB/step':>9} {'ms/step':>8} {'x std at best':>13} {'x std measured':>14}")
    for row in routed:
        print(f"{row['mode']:<22} {row['routing']:>10} "
              f"{row['routing_traffic_s'] * bandwidth / 1e6:9.0f} {1e3 * row['routing_traffic_s']:8.1f} "
              f"{row['tok_per_s_ratio_bound']:13.2f} {row['tok_per_s_ratio']:14.2f}")


def main():
    modes = list(RESIDUAL_MODES) if residual == 'all' else list(dict.fromkeys(residual.split(',')))
    check_settings(globals(), {  # setting: (holds?, what is expected); checks.py
        'residual': (set(modes) <= set(RESIDUAL_MODES), f"'all' or modes from {', '.join(RESIDUAL_MODES)}, joined by commas"),
        'routing': (routing in ('fast', 'naive', 'both'), "'fast', 'naive' or 'both'"),
        'dtype': (dtype in ('float32', 'bfloat16', 'float16'), "'float32', 'bfloat16' or 'float16'"),
        'warmup': (warmup >= 1, 'at least 1 (the first step is timed: with compile, the compile time)'),
        'compile': (isinstance(compile, bool), 'True or False (None: True on a GPU)'),
        'device': (isinstance(device, str) and (device == 'cpu' or (device.startswith('cuda') and gpu)),
                   "'cpu', or 'cuda' / 'cuda:N' on a machine with CUDA"),
    })
    modes = modes if 'standard' in modes else ['standard'] + modes        # the reference of every ratio
    runs = [(m, r) for m in modes for r in (('fast', 'naive') if routing == 'both' else (routing,))
            if not (m == 'standard' and r == 'naive')]     # standard routes nothing
    if compile and cold_compile:    # a warm cache turns a minute of compilation into seconds: measure it cold
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        os.environ['TORCHINDUCTOR_CACHE_DIR'] = cache = tempfile.mkdtemp(prefix='bench_inductor_')
        atexit.register(shutil.rmtree, cache, True)
        inductor_config.fx_graph_cache = inductor_config.autotune_local_cache = False
        functorch_config.enable_autograd_cache = False
    # Every model is another compiled entry for the one GPT.forward; past dynamo's recompile limit (8) a model
    # would silently run eagerly while reported as compiled (--routing=both has 9). Room for all of them, and an
    # error rather than an eager row should that not hold.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(runs))
    torch._dynamo.config.fail_on_recompile_limit_hit = True

    torch.manual_seed(seed)
    ctx = (contextlib.nullcontext() if dtype == 'float32'
           else torch.autocast(device_type='cuda' if device.startswith('cuda') else 'cpu', dtype=getattr(torch, dtype)))
    x, y = (torch.randint(0, vocab_size, (batch_size, block_size), device=device) for _ in range(2))
    # progress on stderr (stdout holds the table or the JSON): building, compiling and warming up takes minutes on a GPU
    rows = [build(m, rt, x, y, ctx) for m, rt in tqdm(runs, desc=f"{'compile + ' if compile else ''}warm up", unit='model')]
    time_rounds(rows)
    std = next(row for row in rows if row['mode'] == 'standard')    # the reference, wherever it is listed
    summarize(rows, std, peak_flops_here())
    setup = dict(device=torch.cuda.get_device_name(device) if device.startswith('cuda') else f'cpu ({torch.get_num_threads()} threads)',
                 torch=torch.__version__, dtype=dtype, compile=compile, compile_regional=compile_regional,
                 n_layer=n_layer, n_embd=n_embd,
                 n_head=n_head, n_kv_head=n_kv_head, head_dim=head_dim, intermediate_size=intermediate_size,
                 n_blocks=n_blocks, vocab_size=vocab_size, block_size=block_size, batch_size=batch_size,
                 warmup=warmup, repeats=repeats, steps=steps, peak_flops=peak_flops_here(),
                 saved='activations saved for backward, eager, each storage once, parameters excluded',
                 peak='torch.cuda.max_memory_allocated of the mode alone' if device.startswith('cuda') else None)
    setup['noise'] = noise_warning(rows)     # None: the rounds agree
    shapes, traffic = modelled_traffic(modes)
    # the bound: the schedule each row runs (fast: two-phase, naive: route()) moving its modelled bytes at this
    # device's bandwidth, added to standard's step
    routed = [row for row in rows if row['mode'] != 'standard']
    setup['bandwidth'] = stream_bandwidth() if routed else None
    for row in routed:
        row['routing_traffic_s'] = traffic['this'][row['mode']][
            'two_phase' if row['routing'] == 'fast' else 'route'] * batch_size * block_size / setup['bandwidth']
        row['tok_per_s_ratio_bound'] = std['seconds_per_step'] / (std['seconds_per_step'] + row['routing_traffic_s'])
    if json:
        print(jsonlib.dumps(dict(setup=setup, rows=rows, traffic=traffic), indent=1))
    else:
        print_tables(setup, rows, shapes, traffic, std)


if __name__ == '__main__':
    main()
