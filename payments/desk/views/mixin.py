"""`DeskViewsMixin`: the desk's extra admin views, mixed into OperationAdmin."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.urls import URLPattern, path

from payments.desk.views.actions import ActionViewsMixin
from payments.desk.views.attention import NeedsAttentionMixin
from payments.desk.views.export import CsvExportMixin
from payments.desk.views.log import DeskLogMixin
from payments.desk.views.queries import provider_events_of
from payments.models import Operation


class DeskViewsMixin(ActionViewsMixin, NeedsAttentionMixin, DeskLogMixin, CsvExportMixin):
    """The desk's extra admin views: their URLs, and what the operation page adds."""

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view
        info = f"{self.opts.app_label}_{self.opts.model_name}"
        desk_urls = [
            path(
                "needs-attention/",
                view(self.needs_attention_view),
                name=f"{info}_needs_attention",
            ),
            path("desk-log/", view(self.desk_log_view), name=f"{info}_desk_log"),
            path("export.csv", view(self.export_csv_view), name=f"{info}_export_csv"),
            path(
                "<path:object_id>/steps/<str:step>/<str:action>/",
                view(self.desk_action_view),
                name=f"{info}_desk_step",
            ),
            path("<path:object_id>/desk/<str:action>/", view(self.desk_action_view), name=f"{info}_desk"),
        ]  # fmt: skip
        return desk_urls + super().get_urls()

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Operation | None = None,
    ) -> HttpResponse:
        """The operation page, with the provider events that touched the operation."""
        if obj is not None:
            context["provider_events"] = provider_events_of(obj)
        return super().render_change_form(request, context, add, change, form_url, obj)
