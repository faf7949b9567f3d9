"""What every desk view shares: the admin it is mixed into and its permission checks."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest

from payments.models import Operation

if TYPE_CHECKING:
    from django.contrib.auth.base_user import AbstractBaseUser

    # The mixins are only ever mixed into a ModelAdmin of Operation (OperationAdmin);
    # at run time their base stays `object`.
    _DeskAdminBase = admin.ModelAdmin[Operation]
else:
    _DeskAdminBase = object

VIEW_PERMISSION = "payments.view_operation"


def operator_of(request: HttpRequest) -> AbstractBaseUser:
    """The signed-in operator: `admin_view` lets only active staff reach the desk."""
    return cast("AbstractBaseUser", request.user)


class DeskBase(_DeskAdminBase):
    """The permission checks every desk view makes."""

    def has_reconcile_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm("payments.reconcile_operation")

    def has_new_attempt_permission(self, request: HttpRequest) -> bool:
        return self.has_reconcile_permission(request) and request.user.has_perm(
            "payments.start_new_attempt"
        )

    def _check_permissions(self, request: HttpRequest, permissions: tuple[str, ...]) -> None:
        """Raise PermissionDenied naming the first permission the user lacks (the 403 shows it)."""
        if not self.has_view_permission(request):
            raise PermissionDenied(VIEW_PERMISSION)
        for permission in permissions:
            if not request.user.has_perm(permission):
                raise PermissionDenied(permission)
