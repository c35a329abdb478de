# Every public header compiles on its own: one translation unit per header under
# include/dtrain that includes it (twice, so the include guard is checked too), built as an
# object library whose only include paths are the installed ones (include/ and the public
# dependencies of `libs`). A header that leans on an include it does not make, or on a
# private header, fails the build. CTest's public_headers_alone builds it again.
file(GLOB_RECURSE DTRAIN_PUBLIC_HEADERS CONFIGURE_DEPENDS RELATIVE ${PROJECT_SOURCE_DIR}/include
     ${PROJECT_SOURCE_DIR}/include/dtrain/*.h)

# dtrain_header_check(TARGET EXCLUDE_GLOB LIBS...): the headers not matching EXCLUDE_GLOB (a
# regular expression after turning * into [^/]*; "" excludes none), or with ONLY_GLOB set
# beforehand only those matching it.
function(dtrain_header_check target exclude)
  set(sources "")
  string(REPLACE "*" "[^/]*" exclude_re "${exclude}")
  string(REPLACE "*" "[^/]*" only_re "${DTRAIN_HEADER_CHECK_ONLY}")
  foreach(header ${DTRAIN_PUBLIC_HEADERS})
    if(NOT exclude_re STREQUAL "" AND header MATCHES "^${exclude_re}$")
      continue()
    endif()
    if(NOT only_re STREQUAL "" AND NOT header MATCHES "^${only_re}$")
      continue()
    endif()
    set(source ${PROJECT_BINARY_DIR}/header_check/${header}.cpp)
    file(CONFIGURE OUTPUT ${source} CONTENT "#include \"${header}\"\n#include \"${header}\"\n")
    list(APPEND sources ${source})
  endforeach()
  add_library(${target} OBJECT ${sources})
  target_link_libraries(${target} PRIVATE ${ARGN})
  if(DTRAIN_BUILD_TESTS)
    add_test(NAME public_headers_alone_${target} COMMAND ${CMAKE_COMMAND} --build ${PROJECT_BINARY_DIR} --target ${target})
    set_tests_properties(public_headers_alone_${target} PROPERTIES RESOURCE_LOCK dtrain_build_tree)
  endif()
endfunction()
