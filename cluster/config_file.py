"""Reading the cluster YAML: overrides, then validation, every error at its file:line.

    deployment = load_deployment("configs/local.yaml", overrides=["router.port=9000"])

1. The file is composed into yaml nodes once, to learn each key's line (and to refuse a
   key given twice), then loaded as plain data.
2. Each override `a.b.c=value` (the CLI's `--set`) replaces that key; its value is read as
   YAML (`9000` is a number, `null` unsets). Its "line" is the flag itself.
3. Each section is built and validated by its own dataclass: `engine:` EngineConfig,
   `cluster:` ClusterConfig, `router:` RouterConfig, `autoscaler:` AutoscalerConfig.
   Validators raise messages that start with the key they refuse ("router.policy: ..."); `locate` finds that key's line.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from vllm_cluster.cluster.autoscaler_config import AutoscalerConfig
from vllm_cluster.cluster.config import ClusterConfig, Deployment
from vllm_cluster.engine.config import EngineConfig, build_section, check_types
from vllm_cluster.engine.errors import ConfigError
from vllm_cluster.worker.router_config import RouterConfig

SECTIONS = ("engine", "cluster", "router", "autoscaler")
_KEY_TOKEN = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")


def load_deployment(path: str | Path, overrides: Iterable[str] = ()) -> Deployment:
    """The validated deployment; a ConfigError names file:line and what to change."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file ({e.strerror})") from None
    lines = {"": f"{path}:1"}
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(e, 'problem', e)}") from None
    if root is not None:
        _collect_lines(root, (), str(path), lines)
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: the file must be a mapping with sections {', '.join(SECTIONS)}")
    for override in overrides:
        _apply_override(data, override, lines)
    return _build(data, lines)


def _collect_lines(node: yaml.Node, prefix: tuple[str, ...], path: str, lines: dict[str, str]) -> None:
    if not isinstance(node, yaml.MappingNode):
        return
    seen: set[str] = set()
    for key_node, value_node in node.value:
        key = str(key_node.value)
        dotted = ".".join((*prefix, key))
        where = f"{path}:{key_node.start_mark.line + 1}"
        if key in seen:
            raise ConfigError(f"{where}: {dotted} is given twice: keep one")
        seen.add(key)
        lines[dotted] = where
        _collect_lines(value_node, (*prefix, key), path, lines)


def _apply_override(data: dict[str, Any], override: str, lines: dict[str, str]) -> None:
    flag = f"--set {override}"
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"{flag}: write it as section.key=value, e.g. --set router.port=9000")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    node = data
    for depth, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
            lines[".".join(parts[: depth + 1])] = flag
        if not isinstance(child, dict):
            raise ConfigError(f"{flag}: {'.'.join(parts[: depth + 1])} is not a section")
        node = child
    node[parts[-1]] = value
    lines[".".join(parts)] = flag


def _build(data: dict[str, Any], lines: dict[str, str]) -> Deployment:
    for key in data:
        if key not in SECTIONS:
            raise _located(f"unknown key {key!r}; valid sections: {', '.join(SECTIONS)}", "", lines, key)
    for section in SECTIONS:
        if data.get(section) is not None and not isinstance(data[section], dict):
            raise _located(f"{section}: must be a mapping, got {type(data[section]).__name__}", "", lines, section)
    try:
        engine = EngineConfig.from_dict(data.get("engine") or {})
    except ConfigError as e:
        raise _located(str(e), "engine", lines) from None
    try:
        cluster = ClusterConfig.from_dict(data.get("cluster"))
    except ConfigError as e:
        raise _located(str(e), "", lines) from None
    try:
        router = build_section(RouterConfig, "router", data.get("router"))
        check_types(router, "router.")
        router.validate()
    except ConfigError as e:
        raise _located(str(e), "", lines) from None
    try:
        autoscaler = AutoscalerConfig.from_dict(data.get("autoscaler"))
    except ConfigError as e:
        raise _located(str(e), "", lines) from None
    return Deployment(engine, cluster, router, autoscaler=autoscaler, lines=lines)


def _located(message: str, section: str, lines: dict[str, str], key: str | None = None) -> ConfigError:
    where = lines.get(key) if key is not None else locate(message, section, lines)
    return ConfigError(f"{where or lines['']}: {message}")


def locate(message: str, section: str, lines: dict[str, str]) -> str | None:
    """Where the key a validator's message names was set: the first word of the message
    that is a known key (inside `section`, whose validators leave its name off), else the
    nearest section of the first dotted name, else the section itself."""
    tokens = _KEY_TOKEN.findall(message)
    candidates = [[f"{section}.{t}", t] if section else [t] for t in tokens]
    for names in candidates:
        for name in names:
            if name in lines:
                return lines[name]
    dotted = next((names[0] for names in candidates if "." in names[-1]), None)
    if dotted is not None:
        parts = dotted.split(".")
        for n in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:n]) in lines:
                return lines[".".join(parts[:n])]
    return lines.get(section)
