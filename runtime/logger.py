"""Run logging: always a metrics.jsonl in the stage folder (what dflash-compare and tests read), plus wandb unless
logger=none. wandb's own settings choose its mode unless logger.mode is given; with no mode configured and no
credentials it runs offline instead of stopping to ask for a key."""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def flatten(metrics: dict, prefix: str = "") -> dict:
    """{"heldout": {"a_k": [..]}} -> {"heldout/a_1": ..}: lists of per-position values become one scalar each."""
    out = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (list, tuple)):
            base = key[:-2] if key.endswith("_k") else key
            out.update({f"{base}_{i + 1}": x for i, x in enumerate(v)})
        else:
            out[key] = v
    return out


def run_name(cfg: DictConfig) -> str:
    """The experiment name, plus the job's overrides when it is one job of a sweep (its folder name)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return f"{cfg.name}/{HydraConfig.get().job.override_dirname}"
    return cfg.name


def wandb_mode(requested: str | None) -> str | None:
    """logger.mode when given; else None (wandb decides from WANDB_MODE, `wandb offline`, `wandb login`), except that
    a default online mode without credentials becomes offline: wandb would otherwise prompt or fail."""
    if requested is not None:
        return str(requested)
    import wandb

    settings = wandb.setup().settings
    if settings.mode != "online":
        return None
    return None if _has_credentials(settings) else "offline"


def _has_credentials(settings) -> bool:
    """Whether wandb would find an API key, read locally: wandb.login() would also look the user up on the server,
    which on a machine without a route to it hangs until a network timeout."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE") or settings.api_key:
        return True
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth  # wandb's own reader knows its host aliases
    except ImportError:  # another wandb layout: the netrc entry for the configured host
        import netrc
        from urllib.parse import urlsplit

        try:
            return netrc.netrc(os.environ.get("NETRC")).authenticators(urlsplit(settings.base_url).netloc) is not None
        except (OSError, netrc.NetrcParseError):
            return False
    try:
        return read_netrc_auth(host=settings.base_url) is not None
    except Exception:  # an unreadable or malformed entry: wandb would not log in with it either
        return False


class RunLogger:
    """resume=True continues the wandb run whose id the stage folder holds (a resumed stage), else starts a new one."""

    ID_FILE = "wandb_run_id"

    def __init__(self, cfg: DictConfig, folder: Path, job: str, enabled: bool = True, resume: bool = False):
        self.enabled = enabled
        self.file = folder / "metrics.jsonl"
        self.wandb = None
        if not enabled:
            return
        folder.mkdir(parents=True, exist_ok=True)
        if cfg.logger.kind == "wandb":
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logger=wandb needs the wandb package: pip install wandb (or logger=none)") from e
            id_file = folder / self.ID_FILE
            run_id = id_file.read_text().strip() if resume and id_file.is_file() else secrets.token_hex(4)
            id_file.write_text(run_id)
            lg = cfg.logger
            self.wandb = wandb.init(project=lg.project, entity=lg.entity, group=lg.group or cfg.name,
                                    tags=list(lg.tags) or None, name=f"{run_name(cfg)}-{job}", job_type=job,
                                    id=run_id, resume="allow", dir=str(folder), mode=wandb_mode(lg.mode),
                                    config=OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
                                    reinit="finish_previous")

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        with open(self.file, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(flatten(metrics), step=step)

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
