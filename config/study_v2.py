# Study v2 (results/README.md, "Study v2"): every residual mode on the offline demo corpus (python prepare_fineweb.py
# --demo), sequences of 256 bytes, 4 per step (the same 1,024 tokens per step as study v1's 16 x 64), 4000 steps =
# 4.1M training tokens. The mode, seed, depth, width, learning rate and out_dir come from the command line
# (results/study_v2.sh runs them all); a seed fixes the initial weights AND the data order, so every mode of one
# seed sees exactly the same batches. Each mode's peak learning rate comes from a grid on seeds the verdicts do not
# use (results/study_v2/grid12, grid24, gridw: best_lr.txt); min_lr is a tenth of it.
dataset = 'demo'
device = 'cpu'
dtype = 'float32'
compile = True                  # inductor: 1.4-1.6x the eager speed on one thread here (measured, results/README.md)
n_layer, n_embd, n_head, n_kv_head, head_dim = 12, 64, 4, 2, 16
intermediate_size = 3 * n_embd
n_blocks = 4                    # attnres / delta_block: 4 blocks (the paper: 4 blocks)
block_size = 256
batch_size = 4
gradient_accumulation_steps = 1
learning_rate = 3e-3
min_lr = 3e-4
max_iters = 4000                # 4000 x 4 x 256 = 4,096,000 training tokens
lr_decay_iters = 4000
warmup_iters = 100
eval_interval = 500
eval_iters = 32                 # 32 x 4 x 256 = 32,768 held-out tokens spread over the val split, every evaluation
final_eval = True               # and at the end the whole val split (265,984 tokens): the number the verdicts use
log_interval = 50
