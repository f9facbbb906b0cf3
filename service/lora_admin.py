"""LoRA adapters at run time, on the management plane: ``POST /v1/load_lora_adapter {"lora_name",
"lora_path"}`` and ``POST /v1/unload_lora_adapter {"lora_name"}`` (the reference server's routes). Only with
``allowRuntimeLoraUpdating``; a path must resolve inside ``loraRoot`` (no ``..`` out, no symbolic link out).
Requests in flight on an adapter being unloaded finish; new ones get the 422 of an unknown adapter.
"""
from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from backends.lora import AdapterError
from backends.settings import LoraSettings
from service.errors import NotFound, ValidationError
from service.http import JsonBodyHandler

log = logging.getLogger("mindserve.lora")

DISABLED = ("runtime LoRA updates are disabled: set BackendConfig.ModelDeployConfig.allowRuntimeLoraUpdating "
            "(and loraRoot) to enable {path}")


def adapter_dir(lora: LoraSettings, requested: str) -> Path:
    """``requested`` (absolute, or relative to ``loraRoot``) resolved, when it is a directory inside the root
    by its real path; ValidationError naming ``lora_path`` otherwise."""
    assert lora.root is not None, "runtime updates need a loraRoot (config check)"
    root = lora.root.resolve()
    path = Path(requested)
    path = path if path.is_absolute() else root / path
    if ".." in path.parts:
        raise ValidationError(f"lora_path {json.dumps(requested)} contains '..'")
    real = path.resolve()
    if real != root and root not in real.parents:
        raise ValidationError(f"lora_path {json.dumps(requested)} is not under the adapter root {root} (loraRoot)"
                              + (" once its symbolic links are followed" if path.absolute() != real else ""))
    if not real.is_dir():
        raise ValidationError(f"lora_path {json.dumps(requested)} is not a directory")
    return real


class _LoraAdminHandler(JsonBodyHandler):
    schema = ""
    openai_401 = True

    @property
    def lora(self) -> LoraSettings:
        return self.ctx.lora

    def body_fields(self) -> dict:
        if not self.lora.runtime_updates:
            raise NotFound(DISABLED.format(path=self.request.path))
        body = self.json_body()
        self.ctx.schemas.validate(self.schema, body)
        return body


class LoadLoraHandler(_LoraAdminHandler):
    schema = "lora_load_request"

    async def post(self) -> None:
        body = self.body_fields()
        name, path = body["lora_name"], adapter_dir(self.lora, body["lora_path"])
        loop = asyncio.get_running_loop()
        try:
            entry = await loop.run_in_executor(None, self.ctx.backend.load_adapter, name, str(path))
        except (AdapterError, ValueError) as exc:
            raise ValidationError(f"lora_name {json.dumps(name)}: {exc}") from None
        log.info("runtime load of LoRA adapter %s from %s", name, path)
        self.write_json({"lora_name": name, "status": "loaded", "adapter": entry})


class UnloadLoraHandler(_LoraAdminHandler):
    schema = "lora_unload_request"

    async def post(self) -> None:
        name = self.body_fields()["lora_name"]
        try:
            freed = self.ctx.backend.unload_adapter(name)
        except KeyError:
            loaded = ", ".join(sorted(a["name"] for a in self.ctx.backend.adapters())) or "none"
            raise NotFound(f"lora_name {json.dumps(name)} is not a loaded adapter (loaded: {loaded})") from None
        self.write_json({"lora_name": name, "status": "unloaded" if freed else "unloading"})


def lora_admin_routes(ctx) -> list:
    args = {"ctx": ctx}
    return [(r"/v1/load_lora_adapter", LoadLoraHandler, args), (r"/v1/unload_lora_adapter", UnloadLoraHandler, args)]
