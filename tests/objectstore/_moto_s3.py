"""moto's S3 server with its conditional writes made atomic, as AWS S3's are.

moto checks a PUT's ``If-None-Match``/``If-Match`` (and a DELETE's ``If-Match``) and then
stores or deletes the object in a second step, with no lock, on a threaded server: under
load two simultaneous ``If-None-Match: *`` PUTs of one key may both pass the check, which
S3 never allows (seen in ``test_object_lease.py``: two racers both won one lease). This
launcher runs ``moto.server`` with every single-request PUT and every DELETE of an object
done one at a time; parts of multipart uploads (no preconditions) still go in parallel.

    python tests/objectstore/_moto_s3.py -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from moto.s3.responses import S3Response
from moto.server import main

_LOCK = threading.Lock()


def _one_at_a_time(handler: Callable[..., Any], *, parallel_parts: bool) -> Callable[..., Any]:
    @functools.wraps(handler)
    def serialized(self: S3Response, *args: Any, **kwargs: Any) -> Any:
        query = args[0] if args and isinstance(args[0], dict) else kwargs.get("query") or {}
        if parallel_parts and query.get("uploadId") and query.get("partNumber"):
            return handler(self, *args, **kwargs)
        with _LOCK:
            return handler(self, *args, **kwargs)
    return serialized


S3Response._key_response_put = _one_at_a_time(S3Response._key_response_put, parallel_parts=True)
S3Response._key_response_delete = _one_at_a_time(S3Response._key_response_delete, parallel_parts=False)

if __name__ == "__main__":
    main()
