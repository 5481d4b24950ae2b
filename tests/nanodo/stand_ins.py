"""Stand-ins for the three packages nanodo imports that are not installed here, set into `sys.modules`
by `install()` before `nanodo.data` / `nanodo.train` / `nanodo.configs.default` are imported.

None of them is used by what the tests run (the model, the loss, the optimizer, the train step):

- `tensorflow_datasets` (nanodo.data's tfds input pipeline): an empty module;
- `clu.metric_writers`, `clu.periodic_actions` (nanodo.train's training loop): empty modules;
- `ml_collections` (the configs): `ConfigDict`, a dict read by attribute as nanodo reads it
  (`c.model.D`, `c.get("grad_accumulation_steps", 1)`), and `config_dict.create`.
"""
import sys
import types


class ConfigDict(dict):
    """A dict whose keys read as attributes, as ml_collections.ConfigDict's do."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value


def install() -> None:
    """Put the stand-ins into `sys.modules` (each only where the real package is missing)."""
    def module(name, **attrs):
        if name not in sys.modules:
            try:
                __import__(name)
            except ImportError:
                sys.modules[name] = types.ModuleType(name)
                sys.modules[name].__dict__.update(attrs)
        return sys.modules[name]

    module("tensorflow_datasets")
    clu = module("clu")
    clu.metric_writers = module("clu.metric_writers")
    clu.periodic_actions = module("clu.periodic_actions")
    config_dict = types.SimpleNamespace(create=lambda **kw: ConfigDict(kw), ConfigDict=ConfigDict)
    module("ml_collections", ConfigDict=ConfigDict, config_dict=config_dict)
