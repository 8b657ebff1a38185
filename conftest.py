"""pytest setup shared by every test file."""
import torch

# The tests use tiny models: intra-op threads only add synchronisation, and on a busy 2-core machine
# they make the suite several times slower. Subprocesses the tests start get OMP_NUM_THREADS=1.
torch.set_num_threads(1)
