"""Private parts of :mod:`gradpipe.dashboard`: its state (``board``) and its page (``page``)."""
