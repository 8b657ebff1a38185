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
