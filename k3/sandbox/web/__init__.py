"""An offline web for browsing tasks: the standard library and Python docs of this machine as
linked pages (``corpus``), a BM25 index (``index``), the search/open/find tools (``tools``), their
relay into network-less sandboxes (``relay``) and the ``browse`` task suite (``tasks``)."""
