"""Parts of ``hicache bench soak``: the traffic it sends and the resources it watches."""
