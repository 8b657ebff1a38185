exec(open('config/_533m.py').read())
residual = 'attnres'
out_dir = 'out/attnres_533m'
wandb_run_name = 'attnres_533m'
