# Study v1 (results/README.md; study v2, config/study_v2.py, replaced it): every residual mode on the offline demo
# corpus (python prepare_fineweb.py --demo), 4000 steps x 16 x 64 = 4.1M training tokens, the smallest budget tried
# at which 'standard' improved from 4 to 12 to 24 layers on each of 3 seeds (the budget search's tables are in git
# history, commit 6240601). About 10-15 minutes per 12-layer run on one CPU thread. The mode,
# seed, depth and out_dir come from the command line (results/cpu_study.sh runs them all); a given seed fixes the
# initial weights AND the data order, so every mode sees exactly the same batches.
dataset = 'demo'
device = 'cpu'
dtype = 'float32'
compile = False
n_layer, n_embd, n_head, n_kv_head, head_dim = 12, 64, 4, 2, 16
intermediate_size = 192
n_blocks = 4                    # attnres / delta_block: 4 blocks (the paper: 4 blocks)
block_size = 64
batch_size = 16
gradient_accumulation_steps = 1
learning_rate = 3e-3
min_lr = 3e-4
max_iters = 4000                # 4000 x 16 x 64 = 4,096,000 training tokens
lr_decay_iters = 4000
warmup_iters = 100
eval_interval = 250
eval_iters = 32                 # 32 x 16 x 64 = 32,768 held-out tokens, the same ones at every evaluation
log_interval = 50
