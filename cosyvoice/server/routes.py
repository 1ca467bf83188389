"""Module-level route handlers for routers made per mount: the studio's feature routers (workbench, long-form)
are mounted on the REST server and on the web UI, each mount over its own state. Their handlers are plain
functions recorded in a :class:`RouteTable` (decorated like a router's); each router a factory makes adds them
all, and hands the mount's state to the handlers that ask for it (``Depends(table.state)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request

Handler = TypeVar("Handler", bound=Callable[..., Any])


class RouteTable:
    """Handlers recorded by method and path (``@table.get("/x")``), added to a router by :meth:`install`."""

    def __init__(self, name: str) -> None:
        self.name = name  # where a request keeps its mount's state (``request.state.<name>``)
        self.routes: list[tuple[str, str, Callable[..., Any], dict[str, Any]]] = []

    def state(self, request: Request) -> Any:
        """The state of the mount serving ``request`` (a dependency of the handlers)."""
        return getattr(request.state, self.name)

    def route(self, method: str, path: str, **options: Any) -> Callable[[Handler], Handler]:
        def record(handler: Handler) -> Handler:
            self.routes.append((method, path, handler, options))
            return handler
        return record

    def get(self, path: str, **options: Any) -> Callable[[Handler], Handler]:
        return self.route("GET", path, **options)

    def post(self, path: str, **options: Any) -> Callable[[Handler], Handler]:
        return self.route("POST", path, **options)

    def patch(self, path: str, **options: Any) -> Callable[[Handler], Handler]:
        return self.route("PATCH", path, **options)

    def delete(self, path: str, **options: Any) -> Callable[[Handler], Handler]:
        return self.route("DELETE", path, **options)

    def install(self, state: object, **router_options: Any) -> APIRouter:
        """A router (``router_options``: prefix, tags, route class) with every recorded handler, over ``state``."""
        def attach(request: Request) -> None:
            setattr(request.state, self.name, state)

        router = APIRouter(dependencies=[Depends(attach)], **router_options)
        for method, path, handler, options in self.routes:
            router.add_api_route(path, handler, methods=[method], **options)
        return router
