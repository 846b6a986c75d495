/* kernel_image.c - embeds the copy kernel's fatbin (see kernel_image.h).
 * The Makefile defines KVF_KERNEL_FATBIN (the fatbin's path) when nvcc was
 * found; without it this build has no kernel and says so at start. */
#include "kernel_image.h"

#ifdef KVF_KERNEL_FATBIN
__asm__(".section .rodata.kvf_fatbin,\"a\",@progbits\n"
        ".balign 64\n"
        "kvf__copy_fatbin_start:\n"
        ".incbin \"" KVF_KERNEL_FATBIN "\"\n"
        "kvf__copy_fatbin_end:\n"
        ".byte 0\n"
        ".previous\n");
extern const unsigned char kvf__copy_fatbin_start[] __asm__("kvf__copy_fatbin_start");
extern const unsigned char kvf__copy_fatbin_end[] __asm__("kvf__copy_fatbin_end");

const unsigned char *kvf__kernel_image(size_t *len) {
  if (len) *len = (size_t)(kvf__copy_fatbin_end - kvf__copy_fatbin_start);
  return kvf__copy_fatbin_start;
}
#else
const unsigned char *kvf__kernel_image(size_t *len) {
  if (len) *len = 0;
  return NULL;
}
#endif
