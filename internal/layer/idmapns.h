#ifndef DSEC_IDMAPNS_H
#define DSEC_IDMAPNS_H
// dsec_idmap_ns returns an open user namespace in which IDs 0..size-1
// are host IDs host.., or -errno (idmapns.c).
int dsec_idmap_ns(unsigned host, unsigned size);
#endif
