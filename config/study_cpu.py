# The CPU study (results/README.md): every residual mode on the offline demo corpus (python prepare_fineweb.py
# --demo), at a token budget where depth helps: 4000 steps x 16 x 64 = 4.1M training tokens, the smallest budget
# tried at which 'standard' improves from 4 to 12 to 24 layers, seed by seed over 3 seeds (results/study_budget_4m;
# at 2.05M it did not: results/study_2m/depth). About 10-15 minutes per 12-layer run on one CPU thread. The mode,
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
