# The CPU study (results/README.md): every residual mode at a shape deep enough for routing to
# collapse or not (8 layers), a minute or two per run on one CPU thread, on the offline demo corpus
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
block_size = 128
batch_size = 16
gradient_accumulation_steps = 1
learning_rate = 3e-3
min_lr = 3e-4
max_iters = 300                 # 300 x 16 x 128 = 614,400 training tokens
lr_decay_iters = 300
warmup_iters = 30
eval_interval = 50
eval_iters = 16                 # 16 x 16 x 128 = 32,768 held-out tokens per evaluation
log_interval = 25
