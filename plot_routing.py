"""
Draw the papers' routing figures as PNGs (needs matplotlib, for this script only: pip install matplotlib).

    python plot_routing.py out-attnres/ckpt.pt out-delta-block/ckpt.pt      # forward passes on val data
    python plot_routing.py out-attnres/log.jsonl out-delta-block/log.jsonl  # the routing train.py logged
    python plot_routing.py /path/to/exported_dir --data_dir=data/demo --out=routing

Each run gives (a) one curve in <out>_max_weight.png: the mean over tokens of the largest routing
weight at every sublayer, by depth (the papers' contrast: ~0.2 in deep AttnRes layers, which spread
their weight to rebuild the residual stream from many sources, vs ~0.6 for Delta, whose routed mix is a
correction added to the intact stream and can pick a few sources),
and (b) <out>_heatmap_<label>.png: the mean weight of each source (columns: E, then sublayer outputs
or blocks) at each sublayer (rows). A checkpoint is measured with forward(stats=True) on the first
--batches val batches of --data_dir (default: the dataset recorded in the checkpoint); a log.jsonl
gives the routing of its last logged step (it is the mean over one training micro-batch).
"""
import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch


def stats_from_log(path):
    """{site: {'max_weight', 'weights'}} of the last record of a train.py log.jsonl that has routing."""
    last = None
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record.get('routing'):
                last = record
    if last is None:
        raise ValueError(f"{path} has no routing records (a 'standard' run, or no step logged yet)")
    return last['routing'], f"step {last['step']}"


@torch.no_grad()
def stats_from_model(model, batches):
    """Token-weighted mean of routing_stats over the batches: {site: {'max_weight', 'weights'}}."""
    model.eval()
    total, n = {}, 0
    for x in batches:
        _, _, stats = model(x, stats=True)
        for site, s in stats.items():
            acc = total.setdefault(site, {'max_weight': 0.0, 'weights': 0.0})
            acc['max_weight'] += s['max_weight'].item() * x.numel()
            acc['weights'] += s['weights'].double().numpy() * x.numel()
        n += x.numel()
    if not total:
        raise ValueError(f"a {model.config.residual!r} model has no routing to plot")
    return {site: {'max_weight': a['max_weight'] / n, 'weights': (a['weights'] / n).tolist()}
            for site, a in total.items()}


def load_stats(source, data_dir=None, batches=4, batch_size=8, block_size=256, residual=None):
    """-> (label, {site: stats}) from a log.jsonl, a train.py ckpt.pt or a checkpoint directory."""
    source = Path(source)
    if source.suffix == '.jsonl':
        stats, when = stats_from_log(source)
        cfg = {}
        ckpt = source.parent / 'ckpt.pt'     # only for the label: which mode this run trained
        if ckpt.is_file():
            cfg = torch.load(ckpt, map_location='cpu', weights_only=False)['model_config']
        return f"{cfg.get('residual', source.parent.name)} ({when})", stats
    from data import ShardLoader, load_meta
    from checkpoints import load_model
    if source.suffix == '.pt':
        model, _ = load_model('resume', str(source.parent))
        data_dir = data_dir or os.path.join('data', torch.load(source, map_location='cpu', weights_only=False)['meta']['name'])
    else:
        model, _ = load_model(str(source), residual=residual)
        if data_dir is None:
            raise ValueError(f"{source} is a checkpoint directory: pass --data_dir with token shards in its vocabulary")
    meta = load_meta(data_dir)
    if meta['vocab_size'] > model.config.vocab_size:
        raise ValueError(f"{data_dir} uses a {meta['vocab_size']}-token vocabulary; the model has {model.config.vocab_size}")
    T = min(block_size, model.config.block_size)
    loader = ShardLoader(data_dir, 'val', batch_size, T)
    xs = [torch.from_numpy(x) for x, _ in loader.val_batches(batches)]
    return model.config.residual, stats_from_model(model, xs)


def sublayer_sites(stats):
    """The per-sublayer sites in depth order ('final' of the replacement modes is left out)."""
    return [s for s in stats if s != 'final']


def plot_max_weight(runs, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, stats in runs:
        sites = sublayer_sites(stats)
        # the first sublayer routes over E alone (weight 1 by definition): start at the second
        ax.plot(range(1, len(sites)), [stats[s]['max_weight'] for s in sites[1:]], marker='o', ms=3, label=label)
    ax.set_xlabel('sublayer depth (attention and MLP sublayers, in order)')
    ax.set_ylabel('mean max routing weight')
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title('How concentrated the routing is')
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_heatmap(label, stats, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    sites = list(stats)
    n_src = max(len(stats[s]['weights']) for s in sites)
    grid = np.full((len(sites), n_src), np.nan)       # NaN: this site does not see that source yet
    for r, s in enumerate(sites):
        w = stats[s]['weights']
        grid[r, :len(w)] = w
    fig, ax = plt.subplots(figsize=(max(5.0, 2.5 + 0.4 * n_src), 1.5 + 0.3 * len(sites)))
    im = ax.imshow(grid, cmap='viridis', vmin=0, vmax=1, aspect='auto')
    if grid.size <= 400:   # small enough to print the numbers
        for (r, c), w in np.ndenumerate(grid):
            if not np.isnan(w):
                ax.text(c, r, f'{w:.2f}', ha='center', va='center', fontsize=6, color='w' if w < 0.6 else 'k')
    ax.set_yticks(range(len(sites)), sites, fontsize=7)
    ax.set_xticks(range(n_src), ['E'] + [str(i) for i in range(1, n_src)], fontsize=7)
    ax.set_xlabel('source: E, then sublayer outputs or blocks\n(block modes: the last one a site sees is the partial block)', fontsize=7)
    ax.set_ylabel('routing site')
    ax.set_title(f'mean routing weights: {label}', fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('sources', nargs='+', help='train.py ckpt.pt files, log.jsonl files or checkpoint directories')
    ap.add_argument('--data_dir', help='token shards to measure checkpoints on (default: the dataset in ckpt.pt)')
    ap.add_argument('--residual', help='checkpoint directory of a plain Qwen3: convert it to this mode first')
    ap.add_argument('--batches', type=int, default=4)
    ap.add_argument('--batch_size', type=int, default=8)
    ap.add_argument('--block_size', type=int, default=256)
    ap.add_argument('--out', default='routing', help='output prefix for the PNGs')
    args = ap.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("plot_routing.py needs matplotlib: pip install matplotlib") from None
    runs = [load_stats(s, args.data_dir, args.batches, args.batch_size, args.block_size, args.residual) for s in args.sources]
    written = [f'{args.out}_max_weight.png']
    plot_max_weight(runs, written[0])
    for i, (label, stats) in enumerate(runs):
        written.append(f"{args.out}_heatmap_{i}_{label.split()[0]}.png")
        plot_heatmap(label, stats, written[-1])
        mw = [stats[s]['max_weight'] for s in sublayer_sites(stats)[1:]]
        print(f"{label}: mean max weight {np.mean(mw):.3f} over {len(mw)} sublayers (min {min(mw):.3f}, max {max(mw):.3f})")
    print('wrote ' + ', '.join(written))


if __name__ == '__main__':
    main()
