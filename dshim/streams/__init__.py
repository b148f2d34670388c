"""Answer streams: the native-stream engine beside the edit engine of :mod:`dshim.render`."""
