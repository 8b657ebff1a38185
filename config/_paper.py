# The paper's training recipe, shared by every <residual>_<scale>.py (shapes come from _<scale>.py).
# One step = 64 sequences of 2048 tokens: 8 GPUs x batch_size 4 x 2 accumulation steps.
# gradient_accumulation_steps counts micro-batches over all processes, so fewer GPUs keep the batch.
batch_size = 4
gradient_accumulation_steps = 16
block_size = 2048
max_iters = 10000
lr_decay_iters = 10000
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 1000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
eval_interval = 500
eval_iters = 64
log_interval = 10
dataset = 'fineweb_edu'
n_blocks = 4
head_dim = 64
# torch.compile each layer's attention and MLP and the routing math apart (train.py's compile_regional) instead of the
# whole model: under DDP the whole graph is cut at every gradient bucket and compiles for many minutes at 36 layers
# (CPU, 2 gloo ranks, Delta AttnRes: 16 minutes to the first step against 2 regionally), for steps 13% faster there
# and as fast at 12 layers (docs/training.md). --compile_regional=False compiles the model whole.
compile_regional = True
