"""The operator's few Kubernetes API calls, on plain dicts.

kubernetes_asyncio provides the configuration (in-cluster service account or
kubeconfig) and the authenticated HTTP client; the calls go through its generic
`call_api` so that objects stay dicts, as the builders make them.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from pagedinfer.operator.spec import GROUP, PLURAL, VERSION

FIELD_MANAGER = "pagedinfer-operator"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"

_PATHS = {
    ("apps/v1", "Deployment"): "/apis/apps/v1/namespaces/{namespace}/deployments",
    ("v1", "Service"): "/api/v1/namespaces/{namespace}/services",
    ("v1", "Pod"): "/api/v1/namespaces/{namespace}/pods",
    (
        f"{GROUP}/{VERSION}",
        "InferenceService",
    ): f"/apis/{GROUP}/{VERSION}/namespaces/{{namespace}}/{PLURAL}",
}

__all__ = ["ApiException", "Kube"]


def _collection(api_version: str, kind: str, namespace: str) -> str:
    return _PATHS[api_version, kind].format(namespace=namespace)


class Kube:
    """Reads and writes of Deployments, Services, Pods and InferenceServices."""

    def __init__(self, api: client.ApiClient) -> None:
        self.api = api

    @classmethod
    async def connect(cls) -> Kube:
        """In a pod, its service account; elsewhere, the current kubeconfig context."""
        # A configuration of our own: kubernetes_asyncio's global default is shared.
        configuration = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=configuration)
        except ConfigException:
            # $KUBECONFIG as it is now, not as it was when kubernetes_asyncio was imported.
            await config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration
            )
        return cls(client.ApiClient(configuration))

    async def credentials(self) -> dict[str, Any]:
        """This client's server and credentials, as kopf.ConnectionInfo's arguments, so
        that kopf and the operator's own calls always use the same."""
        cfg = self.api.configuration
        header = cfg.get_api_key_with_prefix("BearerToken")
        if inspect.isawaitable(header):  # kubernetes_asyncio >= 33.3 refreshes tokens here
            header = await header
        scheme, _, token = (header or "").rpartition(" ")
        return {
            "server": cfg.host,
            "ca_path": cfg.ssl_ca_cert,
            "insecure": not cfg.verify_ssl,
            "scheme": scheme or None,
            "token": token or None,
            "certificate_path": cfg.cert_file,
            "private_key_path": cfg.key_file,
        }

    async def close(self) -> None:
        await self.api.close()

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        query: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        return await self.api.call_api(
            path,
            method,
            query_params=list((query or {}).items()),
            header_params={"Accept": "application/json", "Content-Type": content_type},
            body=body,
            response_types_map={200: "object", 201: "object"},
            auth_settings=["BearerToken"],
            _return_http_data_only=True,
        )

    async def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        try:
            return await self._call("GET", f"{_collection(api_version, kind, namespace)}/{name}")
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        path = _collection(obj["apiVersion"], obj["kind"], obj["metadata"]["namespace"])
        return await self._call("POST", path, body=obj, query={"fieldManager": FIELD_MANAGER})

    async def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply: the fields in `obj` become ours, the rest stays as it is."""
        meta = obj["metadata"]
        path = f"{_collection(obj['apiVersion'], obj['kind'], meta['namespace'])}/{meta['name']}"
        query = {"fieldManager": FIELD_MANAGER, "force": "true"}
        return await self._call("PATCH", path, body=obj, query=query, content_type=APPLY)

    async def patch(
        self,
        api_version: str,
        kind: str,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str = "",
    ) -> dict[str, Any]:
        """A JSON merge patch. With `metadata.resourceVersion` in it, the server refuses
        (409) when the object changed since that version was read."""
        path = f"{_collection(api_version, kind, namespace)}/{name}"
        if subresource:
            path += f"/{subresource}"
        return await self._call(
            "PATCH", path, body=patch, query={"fieldManager": FIELD_MANAGER}, content_type=MERGE
        )

    async def list_pods(self, namespace: str, selector: Mapping[str, str]) -> list[dict]:
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items())
        result = await self._call(
            "GET", _collection("v1", "Pod", namespace), query={"labelSelector": label_selector}
        )
        return list(result.get("items") or [])
