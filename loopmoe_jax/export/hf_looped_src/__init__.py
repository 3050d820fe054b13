"""The modeling source an hf-looped export ships beside its weights (export/hf_looped.py copies
these files into the export directory; transformers imports them there with
trust_remote_code). Plain PyTorch and transformers: nothing here imports loopmoe_jax or JAX,
and loopmoe_jax never imports these modules itself."""
