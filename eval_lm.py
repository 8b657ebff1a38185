"""
Downstream evaluation with lm-evaluation-harness (pip install "lm-eval[hf]", needed for this script only):
0-shot accuracy on the papers' task list, through transformers (the model as export.py writes it).

    python eval_lm.py out/tiny                                  # a train.py out_dir (its ckpt)
    python eval_lm.py exported/qwen3_0.6b_delta_block --batch_size=32
    python eval_lm.py /path/to/Qwen3-0.6B --tasks=hellaswag,arc_easy --limit=200
    python eval_lm.py out-x --tasks=my_task --include_path=my_tasks/   # task YAMLs of your own

It prints a table of per-task accuracy (acc, and acc_norm where the task defines it) with their average,
and writes lm-eval's results as JSON (default: eval_lm.json in the evaluated directory). A train.py run,
a directory from the official code or an older export is first written to a temporary directory by
checkpoints.save_hf (with its tokenizer); a Qwen3 or export.py directory is evaluated as it is.
lm-eval downloads the task datasets from the Hugging Face Hub once (then $HF_DATASETS_CACHE).
See docs/huggingface.md for the expected cost of the full table.
"""
import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from checks import InvalidValue, Missing
from checkpoints import MODEL_TYPE, ROUTING_CONFIG_KEY, load_model, save_hf
from runs import latest
from tokenizer import save_hf_tokenizer

# the official code's downstream list (eval_downstream.py), as reported in the Delta AttnRes paper
PAPER_TASKS = ['hellaswag', 'arc_easy', 'arc_challenge', 'piqa', 'winogrande', 'boolq', 'mmlu', 'lambada_openai']


def transformers_dir(path, tmp, tokenizer=None):
    """A directory that transformers loads as this model: `path` itself when it is one (a Qwen3
    checkpoint, an export with remote code), else the model written to tmp by save_hf."""
    path = Path(path)
    trained = latest(str(path)) is not None     # a train.py out_dir
    if not trained and any(os.path.lexists(path / n) for n in ('ckpt', 'log.jsonl')):
        raise Missing(f"{path} is a train.py out_dir without a checkpoint (its ckpt is missing or dangling); "
                      f"nothing to evaluate (and its other files are not loaded)")
    if (path / 'config.json').is_file() and not trained:
        hf = json.loads((path / 'config.json').read_text())
        plain = hf.get('model_type') == 'qwen3' and (hf.get(ROUTING_CONFIG_KEY) or {}).get('residual', 'standard') == 'standard'
        if (plain or (hf.get('model_type') == MODEL_TYPE and 'auto_map' in hf)) and tokenizer is None:
            return path
        model, recorded = load_model(str(path))
    elif trained:
        model, recorded = load_model('resume', str(path))
    else:
        raise Missing(f"{path} is neither a train.py out_dir (no ckpt) nor a checkpoint directory (no config.json)")
    tokenizer = tokenizer or recorded
    if tokenizer is None:
        raise InvalidValue(f"{path} has no tokenizer; pass --tokenizer (byte, gpt2, a tokenizer.json or directory)")
    save_hf(model, tmp)
    save_hf_tokenizer(tokenizer, tmp, model.config.block_size)
    return Path(tmp)


def evaluate(path, tasks=PAPER_TASKS, limit=None, batch_size=16, device='cpu', dtype='float32', num_fewshot=0,
             include_path=None, tokenizer=None):
    """lm-eval's simple_evaluate on the model at `path` -> its results dict (with the per-request
    log-likelihoods under 'samples')."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager
    # indexing lm-eval's own ~15k task files takes half a minute: skip it when the given tasks are all local
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or not all(t in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path)
    missing = [t for t in tasks if t not in manager.all_tasks]
    if missing:
        raise InvalidValue(f"unknown lm-eval task(s) {missing}; see `lm-eval ls tasks`, or pass --include_path with their YAMLs")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = transformers_dir(path, tmp, tokenizer)
        lm = HFLM(pretrained=str(model_dir), trust_remote_code=True, device=device, dtype=dtype, batch_size=batch_size)
        return lm_eval.simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                                       task_manager=manager, log_samples=True)


def table(results, tasks):
    """-> (the printed table, {task: acc}, mean acc) for the requested tasks (a group such as mmlu: its aggregate)."""
    rows, accs = [f"{'task':<18}{'acc':>8}{'acc_norm':>10}{'n':>8}"], {}
    for t in tasks:
        r = results['results'].get(t) or results.get('groups', {})[t]
        accs[t] = r['acc,none']
        norm = r.get('acc_norm,none')
        n = results.get('n-samples', {}).get(t, {}).get('effective', '')
        rows.append(f"{t:<18}{accs[t]:>8.4f}{'' if norm is None else f'{norm:.4f}':>10}{n:>8}")
    mean = sum(accs.values()) / len(accs)
    rows.append(f"{'average':<18}{mean:>8.4f}")
    return '\n'.join(rows), accs, mean


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    ap.add_argument('path', help='a train.py out_dir (with ckpt) or a Hugging Face checkpoint directory')
    ap.add_argument('--tasks', default=','.join(PAPER_TASKS), help='comma-separated lm-eval tasks (default: the paper\'s)')
    ap.add_argument('--limit', type=float, help='at most this many examples per task (a fraction if < 1); for quick checks')
    ap.add_argument('--num_fewshot', type=int, default=0)
    ap.add_argument('--batch_size', default='16', help="an int, or 'auto'")
    ap.add_argument('--device', default='cuda' if torch.cuda.is_available() else 'cpu')
    ap.add_argument('--dtype', default='bfloat16' if torch.cuda.is_available() else 'float32',
                    choices=['float32', 'bfloat16', 'float16'])
    ap.add_argument('--include_path', help='a directory of task YAMLs of your own')
    ap.add_argument('--tokenizer', help='override the checkpoint\'s tokenizer (byte, gpt2, a tokenizer.json or directory)')
    ap.add_argument('--output', help='the JSON to write (default: PATH/eval_lm.json)')
    args = ap.parse_args(argv)
    tasks = [t for t in args.tasks.split(',') if t]
    limit = None if args.limit is None else int(args.limit) if args.limit >= 1 else args.limit
    batch_size = args.batch_size if args.batch_size == 'auto' else int(args.batch_size)
    results = evaluate(args.path, tasks, limit, batch_size, args.device, args.dtype, args.num_fewshot,
                       args.include_path, args.tokenizer)
    printed, accs, mean = table(results, tasks)
    print(printed)
    out = Path(args.output or Path(args.path) / 'eval_lm.json')
    out.write_text(json.dumps({'path': str(args.path), 'tasks': tasks, 'num_fewshot': args.num_fewshot, 'limit': limit,
                               'dtype': args.dtype, 'acc': accs, 'average_acc': mean,
                               'lm_eval': {k: results[k] for k in ('results', 'n-samples', 'versions', 'configs')
                                           if k in results}}, indent=2, default=str) + '\n')
    print(f"wrote {out}")
    return results


if __name__ == '__main__':
    main()
