/* errors.c - names and messages for kvferry's error codes.
 *
 * One table describes every enum kvf_errc code (KVF_ERR_MAP in kvferry.h);
 * any other negative value is a negative errno. Everything returned is a constant string (strerror's text
 * comes from the C library's constant table via strerrordesc_np), so these
 * functions are thread-safe. */
#include "kvferry.h"

#include <errno.h>
#include <stddef.h>
#include <string.h>

#define KVF_API __attribute__((visibility("default")))

struct err_entry {
  int code;
  const char *name;
  const char *message;
};

/* kvferry's own codes, from the one list in kvferry.h. */
static const struct err_entry kvf_errors[] = {
#define KVF_ERR_XX(name, code, message) {KVF_##name, "KVF_" #name, message},
  KVF_ERR_MAP(KVF_ERR_XX)
#undef KVF_ERR_XX
};

/* errno values stay below the kernel's MAX_ERRNO; anything else is unknown
 * (and negating INT_MIN would overflow). */
#define KVF_ERRNO_MAX 4096

#define ERRNO_NAME(e) {-(e), #e, NULL}

/* Names of the errnos the library and daemon commonly return; the message
 * comes from the C library. */
static const struct err_entry errno_names[] = {
  ERRNO_NAME(EPERM),        ERRNO_NAME(ENOENT),      ERRNO_NAME(EINTR),
  ERRNO_NAME(EIO),          ERRNO_NAME(EBADF),       ERRNO_NAME(EAGAIN),
  ERRNO_NAME(ENOMEM),       ERRNO_NAME(EACCES),      ERRNO_NAME(EFAULT),
  ERRNO_NAME(EBUSY),        ERRNO_NAME(EEXIST),      ERRNO_NAME(ENODEV),
  ERRNO_NAME(ENOTDIR),      ERRNO_NAME(EISDIR),      ERRNO_NAME(EINVAL),
  ERRNO_NAME(ENFILE),       ERRNO_NAME(EMFILE),      ERRNO_NAME(ENOSPC),
  ERRNO_NAME(EPIPE),        ERRNO_NAME(ERANGE),      ERRNO_NAME(ENAMETOOLONG),
  ERRNO_NAME(ENOSYS),       ERRNO_NAME(EPROTO),      ERRNO_NAME(EOVERFLOW),
  ERRNO_NAME(ENOTSOCK),     ERRNO_NAME(EMSGSIZE),    ERRNO_NAME(EPROTONOSUPPORT),
  ERRNO_NAME(EOPNOTSUPP),   ERRNO_NAME(EADDRINUSE),  ERRNO_NAME(EADDRNOTAVAIL),
  ERRNO_NAME(ENETDOWN),     ERRNO_NAME(ENETUNREACH), ERRNO_NAME(ECONNABORTED),
  ERRNO_NAME(ECONNRESET),   ERRNO_NAME(ENOBUFS),     ERRNO_NAME(EISCONN),
  ERRNO_NAME(ENOTCONN),     ERRNO_NAME(ETIMEDOUT),   ERRNO_NAME(ECONNREFUSED),
  ERRNO_NAME(EHOSTUNREACH), ERRNO_NAME(EALREADY),    ERRNO_NAME(EINPROGRESS),
  ERRNO_NAME(ECANCELED),    ERRNO_NAME(ENODATA),     ERRNO_NAME(ESRCH),
  ERRNO_NAME(ESHUTDOWN),
};

static const struct err_entry *lookup(const struct err_entry *table, size_t n, int code) {
  for (size_t i = 0; i < n; i++)
    if (table[i].code == code) return &table[i];
  return NULL;
}

#define LOOKUP(table, code) lookup((table), sizeof(table) / sizeof((table)[0]), (code))

KVF_API const char *kvf_err_name(int err) {
  if (err == 0) return "OK";
  const struct err_entry *e = LOOKUP(kvf_errors, err);
  if (!e) e = LOOKUP(errno_names, err);
  return e ? e->name : "UNKNOWN";
}

KVF_API const char *kvf_strerror(int err) {
  if (err == 0) return "success";
  const struct err_entry *e = LOOKUP(kvf_errors, err);
  if (e) return e->message;
  /* strerrordesc_np returns the constant description, unlike strerror(),
   * which may format "Unknown error N" into a shared buffer. */
  const char *msg = err < 0 && err > -KVF_ERRNO_MAX ? strerrordesc_np(-err) : NULL;
  return msg ? msg : "unknown error";
}
