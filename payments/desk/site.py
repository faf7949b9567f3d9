"""The project's admin site: Django's, with the desk on its home page.

It is `django.contrib.admin.site` itself: `payments.apps.DeskAdminConfig` (in
INSTALLED_APPS in place of django.contrib.admin) names it the default site, so
every `@admin.register`, every app's admin module and `admin.site.urls` use it
unchanged (Django's documented way to customise the default site).
"""

from __future__ import annotations

from typing import Any

from django.contrib.admin import AdminSite
from django.http import HttpRequest
from django.template.response import TemplateResponse

from payments.desk.evidence import incident, incident_html
from payments.desk.views.queries import desk_counts


class DeskAdminSite(AdminSite):
    """The admin whose home page shows the desk: operations to look at, counted per state."""

    index_template = "admin/payments/index.html"
    # The operators' lists need the width: the app sidebar (three links, the same as the
    # breadcrumbs) would clip their columns at 1280 px.
    enable_nav_sidebar = False

    def index(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> TemplateResponse:
        """Give the home page's desk box its counts, to users who may view operations only
        (the box is not shown to others)."""
        extra = dict(extra_context or {})
        if request.user.has_perm("payments.view_operation"):
            extra["desk_counts"] = desk_counts()
            extra["incident"] = incident_html(incident())
        return super().index(request, extra_context=extra)
