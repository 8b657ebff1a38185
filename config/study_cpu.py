# The CPU study (results/README.md): every residual mode at a shape deep enough for routing to
# collapse or not (8 layers), a few minutes per run on one CPU thread, on the offline demo corpus
# (python prepare_fineweb.py --demo). The mode, seed, depth and out_dir come from the command line
# (results/cpu_study.sh runs them all); a given seed fixes the initial weights AND the data order, so
# every mode sees exactly the same batches.
dataset = 'demo'
device = 'cpu'
dtype = 'float32'
compile = False
n_layer, n_embd, n_head, n_kv_head, head_dim = 8, 64, 4, 2, 16
intermediate_size = 192
n_blocks = 4                    # attnres / delta_block: 4 blocks of 2 layers (the paper: 4 blocks)
block_size = 64
batch_size = 16
gradient_accumulation_steps = 1
learning_rate = 3e-3
min_lr = 3e-4
max_iters = 250                 # 250 x 16 x 64 = 256,000 training tokens
lr_decay_iters = 250
warmup_iters = 25
eval_interval = 50
eval_iters = 16                 # 16 x 16 x 64 = 16,384 held-out tokens, the same ones at every evaluation
log_interval = 25
