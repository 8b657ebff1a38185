"""
Train a GPT with any of the five residual modes (model.py) on token shards (prepare_fineweb.py).

On one CPU or GPU:
    python train.py config/delta_block_tiny.py --max_iters=100
With DDP on the 8 GPUs of one node (the paper's runs):
    torchrun --standalone --nproc_per_node=8 train.py config/delta_block_1b.py
Across nodes, e.g. 2 nodes of 8 (run on each, with this node's --node_rank):
    torchrun --nnodes=2 --nproc_per_node=8 --node_rank=0 --master_addr=HOST --master_port=29500 train.py config/...
Continue a run from its last checkpoint (out_dir/ckpt): the same command plus --init_from=resume. With
--init_from=auto the same command starts the run or, when out_dir has a checkpoint, continues it: for
`torchrun --max-restarts=N`, requeued and preemptible jobs (docs/training.md). A new run refuses an out_dir that
holds a checkpoint (--overwrite=True replaces it); out_dir/best is the checkpoint of the best validation loss, and a
run that diverges stops before it can overwrite anything. Checkpoints are sharded (runs.py): every rank writes its own part.
Fine-tune a pretrained Qwen3 (a local Hugging Face directory) converted to any residual mode:
    torchrun --standalone --nproc_per_node=4 train.py config/finetune_qwen3_0.6b_delta_block.py

Settings are the globals below; a config file and --key=value arguments override them (configurator.py).
"""

import inspect
import json
import math
import os
import resource
import signal
import time
from contextlib import nullcontext
from dataclasses import asdict
from datetime import timedelta

from checks import InvalidValue, check_settings, is_count, is_number, print_mistakes

# -----------------------------------------------------------------------------
# default config values: the paper's 220M standard run
# I/O
out_dir = 'out'
eval_interval = 500         # evaluate on the held-out split and write the checkpoint every this many steps
log_interval = 10
eval_iters = 64             # val batches per evaluation, over all processes (fewer if the val split is smaller),
                            # spread evenly over the val split: the same windows at every evaluation (data.py)
final_eval = True           # at the end of training (and with eval_only) also evaluate the whole val split once
eval_only = False           # evaluate once (e.g. with init_from='resume') and exit
init_from = 'scratch'       # 'scratch', 'resume' (from out_dir/ckpt), 'auto' (resume if out_dir has a checkpoint, else
                            # scratch: restarted and requeued jobs) or a local Qwen3 checkpoint directory
overwrite = False           # a new run in an out_dir that holds a checkpoint: replace it (False: refuse to start)
divergence_factor = 2.0     # stop when a val loss or a logged train loss exceeds this x the best val loss so far
                            # (before it can reach a checkpoint); 0 = only non-finite losses stop the run
wandb_log = False           # W&B is optional: only imported when this is on
wandb_project = 'delta-attnres'
wandb_run_name = 'run'
# data
data_root = 'data'
dataset = 'fineweb_edu'     # reads data_root/dataset/ (see prepare_fineweb.py)
batch_size = 4              # sequences per micro-batch per process
gradient_accumulation_steps = 16  # micro-batches per step summed over ALL processes: 8 GPUs x 2 here,
                                  # so one step is 4 x 16 = 64 sequences however many GPUs run it
block_size = 2048
# model
vocab_size = None           # None: the dataset's vocabulary, padded up to a multiple of 64
n_layer = 12
n_head = 12
n_kv_head = 4
n_embd = 768
head_dim = 64
intermediate_size = 3072
rope_theta = 1e6
rms_norm_eps = 1e-6
tie_embeddings = True
residual = 'standard'       # one of model.RESIDUAL_MODES
n_blocks = 4
variant = 'paper'           # 'paper': the papers' definitions; 'official': the authors' code as run (see model.py)
routing_init_std = 0.0      # routing queries at init (from scratch, or a Qwen3 checkpoint's new ones when converting):
                            # 0 = uniform routing (the papers); the authors' code: 0.02
res_gate = False            # additive modes: x = h + gate * routed; with a Qwen3 init_from the gates start at 0,
                            # so the converted model is exactly the pretrained one (see checkpoints.load_hf)
fast_routing = True         # fast_routing.py, checked against route() at start; False: model.route() at every site
                            # (after editing it: the rule as written, with more memory and time)
# AdamW
learning_rate = 6e-4
max_iters = 10000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0             # clip the global gradient norm at this value; 0 = no clipping
routing_learning_rate = None  # None: learning_rate; else the routing parameters' own peak (same schedule shape)
freeze_base = False         # train only the routing parameters (queries, key norms, gates)
# learning rate schedule: linear warmup, then cosine decay to min_lr at lr_decay_iters
decay_lr = True
warmup_iters = 1000
lr_decay_iters = 10000
min_lr = 6e-5
# system
device = None               # None: 'cuda' where torch sees a GPU, else 'cpu'
dtype = None                # 'bfloat16' = autocast, fp32 master weights; None: 'bfloat16' on a GPU, else 'float32'
param_dtype = 'float32'     # 'bfloat16': the weights and AdamW state themselves in BF16, as the authors' code trains
compile = None              # torch.compile the model; None: on a GPU
compile_regional = False    # compile each layer's attention and MLP (one graph each for all layers) and the routing math
                            # (a few graphs for all sites): compile time nearly flat in depth, instead of GPT.forward
                            # whole (always with fsdp)
fsdp = False                # shard parameters, gradients and optimizer state (FSDP2) instead of DDP
activation_checkpointing = False  # recompute attention and MLP activations in the backward pass
peak_flops = 0.0            # per-GPU peak FLOP/s for MFU; 0 = the device's BF16 dense peak (model.PEAK_FLOPS)
seed = 1337
ddp_timeout_s = 1800        # DDP/FSDP: a rank that waits this long on the others (one froze or died) ends the job
                            # with an error instead of hanging; long enough for rank 0 to write an 8B checkpoint
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str, type(None)))]
print_mistakes()    # a mistake in a setting or a file: one line (checks.py); a bug: its traceback
exec(open(os.path.join(os.path.dirname(__file__), 'configurator.py')).read())  # overrides: command line, config file
# torch and the modules that import it load only now, so that --help (configurator.py) answers at once
import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoints import load_hf
from data import ShardLoader, load_meta
from model import GPT, GPTConfig, RESIDUAL_MODES, check_fast_routing, device_peak_flops
from runs import (CheckpointWriteError, Guard, Heartbeat, Stop, append_log, busy_cores, check_resume, clear, differences,
                  init_distributed, latest, lock, open_log, provenance, read_state, resume, save_checkpoint,
                  start_or_resume)

# None: what suits this machine
gpu = torch.cuda.is_available()
device = ('cuda' if gpu else 'cpu') if device is None else device
dtype = ('bfloat16' if gpu else 'float32') if dtype is None else dtype
compile = gpu if compile is None else compile
config = {k: globals()[k] for k in config_keys}  # the full config, logged and saved in checkpoints
# -----------------------------------------------------------------------------

# Check every setting before any work (the model's shape: GPTConfig, below); all problems at once, one line each.
# torchrun sets RANK/LOCAL_RANK/WORLD_SIZE; without them this is a single process.
ddp = 'RANK' in os.environ
world_size = int(os.environ.get('WORLD_SIZE', 1))
check_settings(globals(), {  # setting: (holds?, what is expected); checks.py
    'residual': (residual in RESIDUAL_MODES, f"one of {', '.join(RESIDUAL_MODES)}"),
    'init_from': (init_from in ('scratch', 'resume', 'auto') or os.path.isdir(init_from),
                  "'scratch', 'resume', 'auto' or a local Qwen3 checkpoint directory"),
    'freeze_base': (not (freeze_base and residual == 'standard'),
                    "False with residual='standard', which has no routing parameters to train"),
    'dtype': (dtype in ('float32', 'bfloat16'), "'float32' or 'bfloat16' (float16 would need loss scaling)"),
    'param_dtype': (param_dtype in ('float32', 'bfloat16'), "'float32' or 'bfloat16'"),
    'routing_init_std': (routing_init_std >= 0, '>= 0 (0 = zero queries, uniform routing)'),
    'fsdp': (not fsdp or ddp, "False without torchrun: FSDP shards the model over processes"),
    'gradient_accumulation_steps': (gradient_accumulation_steps >= 1 and gradient_accumulation_steps % world_size == 0,
                                    f">= 1 and divisible by the number of processes, {world_size} (it counts "
                                    f"micro-batches over all processes)"),
    **{k: (globals()[k] >= 1, '>= 1') for k in ('batch_size', 'block_size', 'eval_interval', 'log_interval')},
    'eval_iters': (eval_iters >= world_size, f'>= the number of processes, {world_size} (every rank evaluates a batch)'),
    'max_iters': (max_iters >= 0, '>= 0'),
    'seed': (is_count(seed), 'an integer >= 0'),
    'out_dir': (isinstance(out_dir, str) and out_dir.strip() != '', 'a folder (not empty)'),
    'vocab_size': (vocab_size is None or (isinstance(vocab_size, int) and vocab_size >= 1),
                   "None (the dataset's) or an int >= 1"),
    'learning_rate': (learning_rate >= 0, '>= 0'),
    'routing_learning_rate': (routing_learning_rate is None or (is_number(routing_learning_rate) and routing_learning_rate >= 0
                                                                and learning_rate > 0),
                              'None (learning_rate) or a number >= 0, with learning_rate > 0 (it scales the schedule)'),
    'min_lr': (0 <= min_lr <= learning_rate, f'between 0 and learning_rate={learning_rate}'),
    'warmup_iters': (warmup_iters >= 0 and (not decay_lr or warmup_iters < lr_decay_iters),
                     f'>= 0 and < lr_decay_iters={lr_decay_iters}' + (' (decay_lr=True)' if decay_lr else '')),
    'weight_decay': (weight_decay >= 0, '>= 0'),
    'beta1': (0 <= beta1 < 1, 'in [0, 1)'),
    'beta2': (0 <= beta2 < 1, 'in [0, 1)'),
    'grad_clip': (grad_clip >= 0, '>= 0 (0: no clipping)'),
    'divergence_factor': (divergence_factor == 0 or divergence_factor > 1, '> 1, or 0 to stop only on non-finite losses'),
    'ddp_timeout_s': (ddp_timeout_s > 0, '> 0 seconds'),
    'peak_flops': (peak_flops >= 0, '>= 0 FLOP/s'),
    'device': (isinstance(device, str) and (device == 'cpu' or (device.startswith('cuda') and gpu)),
               "'cpu', or 'cuda' / 'cuda:N' on a machine with CUDA" + ('' if gpu else ' (this one has none)')),
    'compile': (isinstance(compile, bool), 'True or False (None: True on a GPU)'),
})
# one out_dir, one run: locked for this run's life, and only a resume continues what is there (runs.py)
out_dir_lock = lock(out_dir) if int(os.environ.get('RANK', 0)) == 0 else None
auto = init_from == 'auto'
init_from, replaced = start_or_resume(init_from, out_dir, overwrite)   # (replaced: what a new run deletes)

if ddp:
    init_distributed('nccl' if device.startswith('cuda') else 'gloo', timedelta(seconds=ddp_timeout_s))  # runs.py
    rank, local_rank, world_size = dist.get_rank(), int(os.environ['LOCAL_RANK']), dist.get_world_size()
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
else:
    rank, local_rank, world_size = 0, 0, 1
master = rank == 0
accum = gradient_accumulation_steps // world_size  # micro-batches per process per step
tokens_per_iter = gradient_accumulation_steps * batch_size * block_size
device_type = 'cuda' if device.startswith('cuda') else 'cpu'
if master:
    parallel = 'FSDP2' if fsdp else 'DDP' if ddp else 'no data parallelism'
    print(f"{world_size} process(es) x {accum} micro-batches x {batch_size} x {block_size} = "
          f"{tokens_per_iter:,} tokens per step ({parallel}{', activation checkpointing' if activation_checkpointing else ''})")

# Every process uses the same seed: identical initial weights (FSDP shards them without a broadcast);
# the ranks' data differ through the loader, and the model has no dropout.
torch.manual_seed(seed)
if device_type == 'cuda':
    torch.set_float32_matmul_precision('high')  # TF32 for the fp32 matmuls that autocast leaves
autocast = nullcontext() if dtype == 'float32' else torch.autocast(device_type, dtype=torch.bfloat16)

# data: checked against its meta.json as it is opened (data.py)
data_dir = os.path.join(data_root, dataset)
meta = load_meta(data_dir)
train_loader = ShardLoader(data_dir, 'train', batch_size, block_size, rank, world_size, accum, seed, meta=meta)
val_loader = ShardLoader(data_dir, 'val', batch_size, block_size, rank, world_size, meta=meta)

# model
if vocab_size is None:
    vocab_size = math.ceil(meta['vocab_size'] / 64) * 64  # padded: faster matmuls; the extra rows are never targets
elif vocab_size < meta['vocab_size']:
    raise InvalidValue(f"vocab_size={vocab_size} is smaller than the dataset's vocabulary ({meta['vocab_size']}, {meta['tokenizer']})")
try:
    model_config = GPTConfig(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                             n_kv_head=n_kv_head, n_embd=n_embd, head_dim=head_dim, intermediate_size=intermediate_size,
                             rope_theta=rope_theta, rms_norm_eps=rms_norm_eps, tie_embeddings=tie_embeddings,
                             residual=residual, n_blocks=n_blocks, res_gate=res_gate, variant=variant)
except ValueError as e:     # the model's shape, checked by model.py (which imports nothing of this repo)
    raise InvalidValue(str(e)) from None
state = None   # the checkpoint's settings, data position and best losses (state.json) when resuming
if init_from == 'resume':
    state = read_state(latest(out_dir))    # (checks the checkpoint's DCP metadata before anything reads it)
    check_resume(latest(out_dir), state, asdict(model_config), meta, data_dir, config, auto=auto)
    if state['iter_num'] >= max_iters and not eval_only:   # a finished run, started again (e.g. a requeue)
        if master:
            print(f"{latest(out_dir)} is at step {state['iter_num']}, max_iters={max_iters}: nothing left to train "
                  f"(raise --max_iters to continue)")
        if ddp:
            dist.destroy_process_group()
        raise SystemExit(0)
if init_from in ('scratch', 'resume'):
    with torch.device(device):  # build directly on the GPU: no CPU copy of an 8B model per process
        model = GPT(model_config)
else:
    # The config must spell out the checkpoint's shapes (config/_finetune_qwen3_0.6b.py does), so that the run's
    # model_config describes the model and --init_from=resume rebuilds it from the config alone.
    # The RoPE tables only need the training block_size, not the checkpoint's 40,960 positions.
    model = load_hf(init_from, identity_init=res_gate, routing_init_std=routing_init_std, residual=residual,
                    n_blocks=n_blocks, variant=variant, block_size=block_size)
    if diff := differences(asdict(model.config), asdict(model_config)):
        raise InvalidValue(f"init_from={init_from} holds another model than this config describes; set these "
                         f"(checkpoint, config): {diff}")
    model.to(device)
    if master:
        print(f"fine-tuning {init_from} as {residual}" + (" (zero gates: exactly the pretrained model at step 0)"
                                                           if res_gate else ""))
if init_from == 'scratch' and routing_init_std > 0:
    model.init_queries(routing_init_std)    # as the authors' code leaves them: Hugging Face's normal init, not zero
model.fast_routing = fast_routing
if fast_routing:    # fast_routing.py must compute what route() does (an edited route() is refused here, in one line)
    check_fast_routing(model.config)
if param_dtype == 'bfloat16':
    # parameters only: the RoPE tables stay fp32. The optimizer then updates BF16 weights directly, so
    # updates smaller than a weight's rounding step (2^-8 relative) are lost: the authors' recipe, not ours.
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
if freeze_base:
    for name, p in model.named_parameters():
        p.requires_grad_(GPT.is_routing(name))
if master:
    print(f"{residual}: {model.get_num_params() / 1e6:.2f}M parameters "
          f"({model.get_num_params(non_embedding=True) / 1e6:.2f}M without the embedding), vocab {vocab_size}")

# Model.forward calls each layer's self_attn and mlp, not the Layer itself: those two modules are the
# units we checkpoint and shard. What is left (embedding, norms, routing) is small and lives in the root.
if activation_checkpointing:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for layer in model.layers:
        layer.self_attn, layer.mlp = checkpoint_wrapper(layer.self_attn), checkpoint_wrapper(layer.mlp)
if compile and (compile_regional or fsdp):
    # Each layer's attention and MLP compiled: one graph for all attention units and one for all MLPs, however deep
    # the model, and the routing math apart with dynamic shapes (a few graphs for all sites). FSDP2 needs this: dynamo
    # cannot trace its hooks, so the model compiled as a whole would break its graph at every sharded unit and
    # recompile the code between units for each routing site's source count. Without FSDP it trades speed for compile
    # time (docs/training.md).
    graphs = model.compile_regional()    # the routing's graphs per function: dynamo's limit must allow them
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, graphs)
if fsdp:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # With BF16 autocast, the attention and MLP units are all-gathered in BF16 (half the traffic of fp32; autocast
    # would round their weights to BF16 for every matmul anyway) and their gradients reduced in fp32. The root (the
    # embedding, tied to the LM head; norms; routing) keeps fp32, so E and the residual stream stay fp32, as in DDP.
    units = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
             if dtype == 'bfloat16' and param_dtype == 'float32' else MixedPrecisionPolicy())
    for layer in model.layers:
        for unit in (layer.self_attn, layer.mlp):
            fully_shard(unit, mp_policy=units)
    fully_shard(model)
raw_model = model  # the module that owns the parameters (FSDP shards them in place)
routing_lr_scale = 1.0 if routing_learning_rate is None else routing_learning_rate / learning_rate
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), routing_lr_scale)

if peak_flops == 0 and dtype == 'bfloat16' and device_type == 'cuda':
    peak_flops = device_peak_flops(torch.cuda.get_device_name(device))  # None where the table has no entry
iter_num = 0
if state is not None:   # each rank reads its own shards of the weights and optimizer state (DCP reshards)
    resume(latest(out_dir), raw_model, optimizer)   # (the folder read_state checked)
    iter_num, train_loader.pos = state['iter_num'], state['data_pos']
    if master:
        print(f"resumed from {latest(out_dir)} (step {iter_num})")

start_iter = iter_num
guard = Guard(out_dir, divergence_factor, device, state)   # divergence and non-finite stops (runs.py)
run_info = provenance(world_size, device)

if compile and not (compile_regional or fsdp):
    model = torch.compile(model)
if ddp and not fsdp:
    # the only buffers are the RoPE tables, constants that need no re-sending every forward (newer torch names
    # the switch forward_sync_buffers and warns about the older broadcast_buffers)
    no_resend = ('forward_sync_buffers' if 'forward_sync_buffers' in inspect.signature(DDP).parameters
                 else 'broadcast_buffers')
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None, **{no_resend: False})

# Every setting, the data, the model and the checkpoint are checked: only now is out_dir changed
if master:  # an earlier run's checkpoints and log, with overwrite=True (runs.start_or_resume)
    clear(replaced)

# logging: a compact line on stdout, every number in out_dir/log.jsonl
log_path = open_log(out_dir, iter_num if init_from == 'resume' else None,
                    dict(step=iter_num, provenance=run_info, tokenizer=meta['tokenizer'])) if master else None
if wandb_log and master:
    import wandb
    wandb.init(project=wandb_project, name=wandb_run_name, config=config)


def log(record):
    if master:
        if problem := append_log(log_path, record):    # a full disk: one line, and the log stays readable
            print(f"warning: {problem}", flush=True)
        if wandb_log:
            wandb.log({k: v for k, v in record.items() if k != 'routing'}, step=record['step'])


def get_lr(it):
    """Linear warmup to learning_rate, cosine decay to min_lr at lr_decay_iters, then constant."""
    if not decay_lr:
        return learning_rate
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * (it - warmup_iters) / (lr_decay_iters - warmup_iters)))
    return min_lr + coeff * (learning_rate - min_lr)


def to_device(x, y):
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    if device_type == 'cuda':  # pinned memory + non_blocking: the copy overlaps with the GPU's work
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


@torch.no_grad()
def evaluate(n):
    """Mean loss per target token over n val batches, or the whole val split (n=None); each process takes
    different batches. Returns the loss and the number of held-out tokens it averages."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)    # sum of token losses, number of tokens
    for x, y in val_loader.val_batches(n):
        targets = int((y >= 0).sum())   # the whole split's last batch has filler rows without targets
        x, y = to_device(x, y)
        with autocast:
            _, loss = model(x, y)
        if targets:
            total[0] += loss.double() * targets
            total[1] += targets
    if ddp:
        dist.all_reduce(total)
    model.train()
    loss_sum, tokens = total.tolist()
    return loss_sum / tokens, int(tokens)


def routing_summary(stats):
    """One line for many sublayers: mean [min, max] over sites of the max weight and the entropy.
    Sites with a single source (the first sublayer routes over the embedding alone) are left out."""
    stats = [s for s in stats.values() if len(s['weights']) > 1]
    if not stats:
        return ''
    mw = [s['max_weight'] for s in stats]
    ent = [s['entropy'] for s in stats]
    return (f" | routing max_w {np.mean(mw):.2f} [{min(mw):.2f}, {max(mw):.2f}]"
            f" entropy {np.mean(ent):.2f} [{min(ent):.2f}, {max(ent):.2f}]")


def checkpoint(val_loss):
    """Every rank: write out_dir/step_N and point out_dir/ckpt (and out_dir/best, for the lowest val loss) at it.
    val_loss None: a checkpoint without an evaluation (a run stopped by a signal), never the best."""
    is_best = val_loss is not None and guard.is_best(val_loss)
    state = dict(model_config=asdict(model_config), config=config, meta=meta, iter_num=iter_num,
                 data_pos=train_loader.pos, best_val_loss=guard.best_val_loss,
                 best_ckpt=[iter_num, val_loss] if is_best else guard.best_ckpt, provenance=run_info)
    try:
        path = save_checkpoint(out_dir, iter_num, raw_model, optimizer, state, is_best, master)
    except CheckpointWriteError as e:
        guard.stop(f"{e} {guard.kept()}")
    guard.saved(iter_num, val_loss, is_best)
    if master:
        print(f"step {iter_num}: saved {path}" + (" (best val loss so far)" if is_best else
                                                  f" (best: step {guard.best_ckpt[0]}, val loss {guard.best_ckpt[1]:.4f})"
                                                  if guard.best_ckpt else ""))


def ppl(loss):
    return math.exp(loss) if loss < 700 else float('inf')  # math.exp overflows past ~709.78


def log_step(lossf, lr, grad_norm, dt, stats):
    """The compact line on stdout and the full record (with each site's routing weights) in log.jsonl."""
    tok_s = tokens_per_iter / dt
    mfu = raw_model.estimate_mfu(batch_size * accum, dt, peak_flops) if peak_flops else None
    if device_type == 'cuda':
        mem = torch.cuda.max_memory_allocated() / 2**30
    else:  # peak resident set size of this process (kilobytes on Linux)
        mem = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    routing = {site: {'max_weight': s['max_weight'].item(), 'entropy': s['entropy'].item(),
                      'weights': s['weights'].tolist()} for site, s in stats.items()}
    print(f"step {iter_num}: loss {lossf:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
          f"{tok_s:,.0f} tok/s | mfu {f'{100 * mfu:.1f}%' if mfu is not None else '-'} | "
          f"mem {mem:.2f} GiB{routing_summary(routing)}")
    log(dict(step=iter_num, loss=lossf, lr=lr, grad_norm=grad_norm, tok_per_s=tok_s, mfu=mfu, mem_gib=mem,
             routing=routing))
    busy_cores_once()


def busy_cores_once():
    """On a CPU, at the start and at each logged step until it has been said once: are the cores busy?"""
    global said_busy
    if device_type == 'cpu' and not said_busy and (note := busy_cores(torch.get_num_threads())):
        print(note, flush=True)
        said_busy = True


# -----------------------------------------------------------------------------
# training loop. iter_num counts optimizer steps taken; "step k" is the k-th one.
t0, steps_timed = time.time(), 0
if device_type == 'cuda':
    torch.cuda.reset_peak_memory_stats()
stop, signum = Stop(device, master), 0     # SIGTERM / SIGINT: finish the step, checkpoint, exit (runs.py)
said_busy = not master
busy_cores_once()
if compile and master:
    print("torch.compile: the first evaluation and the first training step compile the model (minutes when deep)")
while True:
    if (iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only) and \
            not (iter_num == start_iter and init_from == 'resume' and not eval_only):
        guard.stop_if_skipped(iter_num)   # never evaluate or checkpoint after a skipped step
        with Heartbeat('compiling the evaluation', on=compile and master and iter_num == start_iter):
            val_loss, val_tokens = evaluate(eval_iters)
        if master:
            print(f"step {iter_num}: val loss {val_loss:.4f} | val ppl {ppl(val_loss):.2f} "
                  f"({val_tokens:,} held-out tokens)")
        log(dict(step=iter_num, val_loss=val_loss, val_ppl=ppl(val_loss), val_tokens=val_tokens))
        guard.check(iter_num, val_loss, 'val loss')
        if final_eval and (iter_num >= max_iters or eval_only):   # the number to compare runs by (results/)
            whole, whole_tokens = evaluate(None)
            if master:
                print(f"step {iter_num}: whole val split: loss {whole:.4f} | ppl {ppl(whole):.2f} "
                      f"({whole_tokens:,} tokens)")
            log(dict(step=iter_num, final_val_loss=whole, final_val_tokens=whole_tokens))
        if iter_num > start_iter:
            checkpoint(val_loss)
        t0, steps_timed = time.time(), 0  # don't count evaluation time as training time
    if iter_num >= max_iters or eval_only:
        break
    if signum := stop.requested(logged=iter_num % log_interval == 0 or iter_num == start_iter + 1):
        break

    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group['lr'] = lr * group['lr_scale']   # the routing group may have its own scale (routing_learning_rate)
    want_stats = (iter_num + 1) % log_interval == 0
    loss_sum = torch.zeros((), device=device)
    first = iter_num == start_iter or (want_stats and iter_num < start_iter + log_interval)  # (+ its stats graph)
    with Heartbeat('compiling the training step', on=compile and master and first):
        for micro, (x, y) in enumerate(train_loader.train_batches()):
            x, y = to_device(x, y)
            last = micro == accum - 1
            # DDP all-reduces the gradients only once, after the last micro-batch. FSDP reduce-scatters them after
            # every micro-batch (its default): skipping that would hold the whole model's unsharded fp32 gradients
            # on every GPU between micro-batches (33 GB at 8B), for one reduce-scatter saved per micro-batch.
            if ddp and not fsdp:
                model.require_backward_grad_sync = last
            with autocast:
                if want_stats and last:
                    _, loss, stats = model(x, y, stats=True)
                else:
                    _, loss = model(x, y)
            (loss / accum).backward()
            loss_sum += loss.detach() / accum
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float('inf'))
    if hasattr(grad_norm, 'full_tensor'):  # FSDP: a DTensor
        grad_norm = grad_norm.full_tensor()
    guard.skip_if_nonfinite(optimizer, iter_num, loss_sum, grad_norm)   # on the device: no host sync
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    steps_timed += 1
    if iter_num == start_iter + 1 and master and iter_num % log_interval:   # a sign of life before the first log line
        loss_sum.item()     # (waits for the device: the time below is the step's)
        print(f"step {iter_num}: first step took {time.time() - t0:.1f} s" + (" (compiling)" if compile else "")
              + f"; the next line at step {log_interval * (iter_num // log_interval + 1)}")

    if iter_num % log_interval == 0:
        guard.stop_if_skipped(iter_num)
        if ddp:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.AVG)  # the loss of the whole global batch
        lossf = loss_sum.item()  # waits for the GPU, so the time below is real
        if master:
            log_step(lossf, lr, grad_norm.item(), (time.time() - t0) / steps_timed, stats)
        t0, steps_timed = time.time(), 0
        guard.check(iter_num, lossf, 'train loss')

if signum:
    guard.stop_if_skipped(iter_num)   # never checkpoint after a skipped step
    # Before the first step there is nothing to save (and DCP would fill the optimizer's empty state by stepping it):
    # a new run then restarts from scratch, a resumed one from the checkpoint it began with.
    if guard.last_ckpt != iter_num and iter_num > start_iter:
        checkpoint(None)
    if master:
        print(f"step {iter_num}: stopped by {signal.Signals(signum).name}"
              + ("" if guard.last_ckpt is not None else " before any checkpoint: nothing saved")
              + "; continue with the same command and --init_from=auto" + ("" if guard.last_ckpt is None else
                                                                           " (or resume)"))
if ddp:
    dist.destroy_process_group()
if out_dir_lock:
    out_dir_lock.close()    # (the process's end would release it too; this frees it for a run in the same process)
if signum:
    raise SystemExit(128 + signum)   # the signal's conventional exit code
