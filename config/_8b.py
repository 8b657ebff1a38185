# Qwen3-8B's shape (untied embeddings, like Qwen3-8B), half the paper's learning rate and warmup.
# FSDP2 + activation checkpointing: fp32 weights, grads and AdamW state (16 bytes/param = 131 GB)
# do not fit one GPU, sharded over 8 they take 16 GB each.
exec(open('config/_paper.py').read())
n_embd, n_layer, n_head, n_kv_head, head_dim = 4096, 36, 32, 8, 128
intermediate_size = 12288
tie_embeddings = False
learning_rate = 3e-4
min_lr = 3e-5
warmup_iters = 500
fsdp = True
activation_checkpointing = True
# the same 64 sequences per step as every scale, in micro-batches of 2: at 4, the saved activations (fp32 residual
# stream and norm inputs at d=4096, the fp32 logits) take Delta Block to about 71 GiB of an 80 GiB H100;
# at 2, about 49 (test_memory.py)
batch_size = 2
gradient_accumulation_steps = 32
