exec(open('config/_1b.py').read())
residual = 'full_attnres'
out_dir = 'out/full_attnres_1b'
wandb_run_name = 'full_attnres_1b'
